"""The status board that names dead ranks stays bounded: one key per rank, one batched read per probe, and the
store's timeout untouched. Four ranks' boards share a real TCPStore, as torchrun's workers share the agent's."""

import datetime
import time

import pytest
import torch.distributed as dist

from twinkle_strategy.distributed.liveness import StatusBoard

WORLD = 4


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=7))


class CountingStore:
    """The real store, counting the calls a probe makes (the methods are TCPStore's own)."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.store, name)


def boards(store, name):
    made = []
    for rank in range(WORLD):  # each rank is a process of its own: the same namespace for all
        made.append(StatusBoard(name, store=store, rank=rank, world=WORLD, namespace=name))
    return made


def test_keys_do_not_grow_with_steps(store):
    ranks = boards(store, "steps")
    counts = {}
    for step in range(1, 201):
        for board in ranks:
            board.finished(f"step{step}")
        if step in (1, 10, 200):
            counts[step] = store.num_keys()
    assert counts[1] == counts[10] == counts[200], counts
    assert all(store.get(key) == b"200" for key in ranks[0].keys)


def test_a_probe_names_the_silent_rank_with_one_batched_read_and_keeps_the_timeout(store):
    ranks = boards(store, "probe")
    for step in range(1, 6):
        for board in ranks[:3] if step == 5 else ranks:  # rank 3 dies during step 5
            board.finished(f"step{step}")
    ranks[1].failed("RuntimeError in step6")
    ranks[0].failed("RuntimeError in step6")  # a rank records its own failure, then probes
    counting = CountingStore(store)
    ranks[0].store = counting
    start = time.monotonic()
    # Rank 0 is in step 6: rank 2 finished step 5 but not 6, rank 1 failed, rank 3 never finished step 5.
    assert ranks[0].silent_ranks("step6", grace_s=0.5) == [2, 3]
    assert time.monotonic() - start < 3
    polls = counting.calls.count("multi_get")
    assert polls >= 1 and counting.calls.count("check") == polls and set(counting.calls) == {"check", "multi_get"}
    assert store.timeout == datetime.timedelta(seconds=7)
    # Had rank 3 failed in step 5 instead, it would see the others as having got at least as far.
    ranks[3].failed("RuntimeError in step5")
    assert ranks[3].silent_ranks("step5", grace_s=0) == []


def test_a_rank_that_never_reported_is_named_without_waiting_for_its_key(store):
    board = StatusBoard("early", store=store, rank=1, world=WORLD)  # rank 0, which creates every key, died
    board.failed("RuntimeError during plan")
    start = time.monotonic()
    assert board.silent_ranks("plan", grace_s=0.3) == [0, 2, 3]
    assert time.monotonic() - start < 3  # not the store's 7 s timeout


def test_the_init_and_the_trainer_name_who_stopped_in_the_same_words(store):
    ranks = boards(store, "who")
    for board in ranks:
        board.finished("step1")
    ranks[2].finished("step2")
    ranks[1].failed("RuntimeError in step2")
    ranks[0].failed("RuntimeError in step2")
    who, failures = ranks[0].who_stopped("step2", grace_s=0)
    assert who == ("rank 1 failed: RuntimeError in step2; "
                   "rank(s) [3] did not report back (one of them died or hung; see their logs)")
    assert failures == [(1, "RuntimeError in step2"), (3, "did not report back")]
    quiet = boards(store, "quiet")  # every other rank got further: nobody to name
    for board in quiet[1:]:
        board.finished("step1")
    quiet[0].failed("RuntimeError in step1")
    assert quiet[0].who_stopped("step1", grace_s=0) == ("a peer stopped responding", [])


def test_who_stopped_names_the_cause_not_the_ranks_it_stranded(store):
    """The issue's run: ranks 1 and 3 raised on their own, rank 2 lost its connection to one of them first."""
    ranks = boards(store, "cause")
    ranks[2].failed("RuntimeError in step1", after_peer=True)
    ranks[1].failed("ModelStructureError: router_aux_loss_coef: ...")
    ranks[3].failed("ModelStructureError: router_aux_loss_coef: ...")
    ranks[0].failed("RuntimeError in step1", after_peer=True)
    who, failures = ranks[0].who_stopped("step1", grace_s=0)
    assert who == ("rank 1 failed: ModelStructureError: router_aux_loss_coef: ...; "
                   "rank 3 failed: ModelStructureError: router_aux_loss_coef: ...")
    assert [rank for rank, _ in failures] == [1, 3, 2]
    alone = boards(store, "alone")  # nobody failed on their own: the stranded ones are named
    for board in alone[1:3]:
        board.finished("step1")
    alone[3].failed("RuntimeError in step1", after_peer=True)
    alone[0].failed("RuntimeError in step1", after_peer=True)
    assert alone[0].who_stopped("step1", grace_s=0)[0] == "rank 3 failed after a peer (RuntimeError in step1)"
