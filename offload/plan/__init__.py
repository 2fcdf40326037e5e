"""tierflow.offload.plan: where each layer and expert lives and computes, and how fast that runs.

    planner.py      make_plan: placement under the budgets (GPU first, RAM, then the streamed ring)
    plan_result.py  Plan: what a placement holds per tier, its predictions, how `tierflow plan` prints it
    context.py      the context a load gets: the trained one if the budgets hold it, else the most they do
    expert_plan.py  a MoE model's experts: their home, their cache and its size, their cost per pass
    cost_model.py   seconds per layer stage and the read-ahead pipeline of a pass
    pass_costs.py   a planned model's pass over T tokens (a speculative tree's verify or draft pass)
    budgets.py      what a model takes besides its weights (the KV cache by type and layer, activations),
                    the RAM on offer
    profile.py      HardwareProfile: the machine's measured speeds, cached per thread count
    probe.py        measures disk, RAM and kernel speeds (`tierflow probe`)
    measure.py      the measuring helpers the probe and benchmarks/kernels.py share
"""
