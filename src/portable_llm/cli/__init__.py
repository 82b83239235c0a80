"""The ``portable-llm`` command line: report, bench, generate and batch."""
