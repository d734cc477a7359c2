"""plait.plan — the cost model: which N-D layout fits and runs fastest, before the job starts.

    plait.train's config + world size -> layouts.enumerate (every dims/schedule/microbatch/AC
    choice, each checked by plait.train.layout.check: kept, or rejected with its numbers)
    -> per layout and rank: shapes (what a rank holds) -> traffic (bytes per mesh axis, exact:
       tests/plan compare them with plait.comm's counts), memory (bytes per component),
       timing (roofline: FLOPs / FLOP rate + exposed comm + the pipeline simulator's bubble)
    -> planner.plan ranks them; cli prints the table (`plait plan`), or JSON

torch-free: `plait plan` starts without importing torch (calibrate imports it for its probe).
"""
