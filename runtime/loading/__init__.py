"""tierflow.runtime.loading: a model file to a decoder ready to run, within the budgets.

    loader.py     the one loader: budgets, plan, pack, weights (Engine.load, drafts, plan, info)
    overhead.py   the per-layer fixed cost of a pass, measured per model shape for the planner
"""
