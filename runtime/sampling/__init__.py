"""tierflow.runtime.sampling: logits to a token.

    sampler.py        sampling settings and the sampler: its logits processors, then the filters and the pick
    processors.py     the logits processors: logit bias, penalties, a grammar's mask, in order
    logprobs.py       each generated token's log-probability and top alternatives
    structured.py     structured output: grammars (JSON schema, regex, Lark, GBNF) and their matchers
    schema_checks.py  a JSON schema too wide for the grammar engine, or with no finite instance, refused
"""
