"""A fuzzer for model files: a bad file must be refused with a TierflowError, never crash, hang,
grow without bound or raise anything else.

    seeds.py       small valid models of every family (make_model), parsed into editable parts
    values.py      hostile values: boundary numbers, wrong types, attacking chat templates
    mutations.py   one edit each, stated in full (metadata, tensor table, weights, raw bytes)
    mutators.py    random edits of a seed, by family
    cases.py       a case: a seed and its edits, drawn from its number alone
    corpus.py      named cases: the attacker's findings, and findings not yet fixed
    workload.py    what a case's child does: build the file, load, generate, chat, describe
    forkserver.py  imports tierflow once, then forks a limited child per case
    harness.py     starts the fork server and collects how each case ended
    __main__.py    `python -m tests.fuzz`: rerun a case, or a long run
"""
