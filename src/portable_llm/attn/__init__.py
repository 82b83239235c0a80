"""Attention: masks and the one visibility rule, SDPA, the attention block, paged attention."""
