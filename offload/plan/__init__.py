"""tierflow.offload.plan: where each layer and expert lives and computes, and how fast that runs.

    planner.py      make_plan: placement under the budgets (GPU first, RAM, then the streamed ring), Plan
    expert_plan.py  a MoE model's experts: their home, their cache and its size, their cost per pass
    cost_model.py   seconds per layer stage and the read-ahead pipeline of a pass
    budgets.py      what a model takes besides its weights (KV cache, activations), the RAM on offer
    profile.py      HardwareProfile: the machine's measured speeds, cached per thread count
    probe.py        measures disk, RAM and kernel speeds (`tierflow probe`)
    measure.py      the measuring helpers the probe and benchmarks/kernels.py share
"""
