"""The terminal agent: action formats, token bookkeeping and the multi-turn loop."""
