"""The run dashboard: `agentrl dashboard RUN_DIR [RUN_DIR ...]` serves a local page with a run's
curves (several runs overlaid) and an episode browser, read from the run directories' files alone
(a finished run, a live one, or a copied directory). docs/dashboard.md describes it.

    tail.py     JSONL read incrementally by byte offset (half-written and malformed lines counted)
    records.py  the episode index and one episode for the page
    run.py      one run directory and the curves derived from its metrics
    tokens.py   token ids -> text with the run's tokenizer, when it can be found
    server.py   the aiohttp server and its JSON endpoints; page.html is the page
    sinks.py    optional metric sinks of the runtime (W&B, TensorBoard)

Nothing here is imported by `agentrl --help`; the server imports aiohttp only when started.
"""
