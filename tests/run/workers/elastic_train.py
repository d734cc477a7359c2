"""`plait run -m tests.run.workers.elastic_train ARGS` ≡ `plait run -m plait.train ARGS`, plus two
test seams, so the elastic test (tests/run/test_elastic_train.py) can lose a node at a known step:

- with `--nnodes 1:2` the first agent may start a round alone when the second is slow to
  join; such a round (world ELASTIC_SMALL_WORLD) holds before training until the file
  NODE_LOST exists, so it never trains: the second node's arrival regroups it (no restart
  spent), and only the round after the test has killed a node trains on the small world;
- every rank appends the sample indices it draws to indices_w<world>_r<rank>.jsonl (with the
  stream's global position before the draw), so the test can check the global stream;
- in the big world, a rank whose agent was started with ELASTIC_VICTIM=1 stops at the save
  of step ELASTIC_PAUSE_STEP: it writes paused_r<rank> and sleeps until its node is killed.
  Its peers meanwhile enter that save's collective and wait for it — the node is lost with a
  checkpoint in flight, after the previous one is complete.

Nothing else of the trainer is changed: the command line, the config and the loop are
`python -m plait.train`'s.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tests.run.workers import _common

_common.register()
RANK, WORLD = _common.rank(), _common.world()
BOUND_S = _common.HANG_S + 60.0  # past the test's own bound: the test always acts first; then fail loudly


def _record_indices() -> None:
    from plait.train.data import BatchStream

    draw = BatchStream.next_indices
    path = os.path.join(_common.OUT, f"indices_w{WORLD}_r{RANK}.jsonl")

    def next_indices(self):
        before = self.state_dict()
        idx = draw(self)
        with open(path, "a") as f:
            f.write(json.dumps({"epoch": before["epoch"], "consumed": before["consumed"],
                                "indices": idx.tolist()}) + "\n")
        return idx

    BatchStream.next_indices = next_indices


def _pause_victim() -> None:
    from plait.train.checkpointing import Checkpointer

    save, pause_step = Checkpointer.save, int(os.environ["ELASTIC_PAUSE_STEP"])

    def paused_save(self, state, step, *, final=False):
        if step == pause_step:
            _common.write(f"paused_r{RANK}", {"pid": os.getpid(), "step": step})
            time.sleep(BOUND_S)  # the test kills this node long before
            raise SystemExit(3)
        return save(self, state, step, final=final)

    Checkpointer.save = paused_save


def _hold_until_node_lost() -> None:
    deadline = time.monotonic() + BOUND_S
    while not os.path.exists(os.path.join(_common.OUT, "NODE_LOST")):
        if time.monotonic() > deadline:
            raise SystemExit(4)
        time.sleep(0.05)


if WORLD == int(os.environ["ELASTIC_SMALL_WORLD"]):
    _hold_until_node_lost()
_record_indices()
if WORLD > int(os.environ["ELASTIC_SMALL_WORLD"]) and os.environ.get("ELASTIC_VICTIM") == "1":
    _pause_victim()

from plait.train.cli import main  # noqa: E402 - after the seams are in place

sys.exit(main(sys.argv[1:]))
