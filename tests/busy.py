"""What the tests need to hold on a busy machine (CI shares its 2 cores;
scripts/busy-test.sh runs the suite beside a hog on each): one decoding thread, and the
step costs a test charges an engine (``StepTimer.costs``) where it asserts on a decision
made from step times (drafting, bursts of prefill, moving a lane), in the proportions
these 2 cores give when quiet."""

from __future__ import annotations

from proxy.engine.timing import StepCosts

# One thread: ggml's threads meet at a spinning barrier after every operation, so a
# decode beside a busy process slows by far more than the CPU it loses
# (docs/configuration.md, "Threads on a busy machine"): a 5-token request took 1 to 11 s
# with two threads beside a hog on each of these 2 cores, 0.1 to 0.9 s with one
THREADS = 1

# The tiny synthetic models: a step under a millisecond, where a drafted token adds more
# than a step of one (docs/design.md, "Drafting from a copy"), a draft model's token
# costs about a target's step, and a prompt lookup more than 2% of a step (a resting
# lane does not watch)
TINY_COSTS = StepCosts(decode_s=0.001, lane_s=0.0005, prefill_s=0.0002, draft_s=0.0012,
                       model_s=0.001, lookup_s=0.0001)
# Gemma 3 270M: 25 ms a token, a drafted token's logits row (a 262k-token vocabulary)
# about 7 ms (tests/unit/test_adaptive.py's STEP and PER_DRAFT)
GEMMA_COSTS = StepCosts(decode_s=0.025, lane_s=0.005, prefill_s=0.001, draft_s=0.055 / 8,
                        model_s=0.0, lookup_s=0.0001)
