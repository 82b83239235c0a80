"""``python -m portable_llm [report|bench] ...``; with no arguments, the accuracy report."""

from portable_llm.cli.cli import main

raise SystemExit(main())
