"""`rollout.setup_gc`: the cyclic collector paused while a run sets up, back on (its survivors
frozen) when the loop starts, and everything as it was when the pause ends."""

from __future__ import annotations

import gc

import pytest

from rollout import setup_gc


@pytest.fixture(autouse=True)
def _collector_restored():
    # these tests count frozen objects from zero: a heap frozen before them (seen once in a pytest
    # worker on a lent GPU machine's image: 375 objects) is thawed first
    gc.unfreeze()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    yield
    gc.unfreeze()
    gc.enable()


def test_a_pause_turns_automatic_collection_off_and_back_on():
    with setup_gc.paused_for_setup():
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_setup_done_collects_the_setups_cycles_freezes_the_rest_and_resumes():
    class Node:
        pass

    with setup_gc.paused_for_setup():
        kept = [Node() for _ in range(100)]
        for _ in range(500):  # cycles nobody holds: only the cyclic collector frees them
            a, b = Node(), Node()
            a.other, b.other = b, a
        del a, b
        garbage_before = sum(isinstance(o, Node) for o in gc.get_objects())
        setup_gc.setup_done()
        assert gc.isenabled()
        assert garbage_before == 1100
        assert sum(isinstance(o, Node) for o in gc.get_objects()) == 0  # the cycles went; the rest is frozen
        assert gc.get_freeze_count() >= len(kept)
    assert gc.isenabled() and gc.get_freeze_count() == 0  # unfrozen at the pause's end


def test_the_pause_ends_cleanly_when_setup_fails():
    with pytest.raises(RuntimeError, match="no model"), setup_gc.paused_for_setup():
        raise RuntimeError("no model")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    setup_gc.setup_done()  # a later loop outside any pause: nothing to do
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_setup_done_outside_a_pause_changes_nothing():
    setup_gc.setup_done()
    assert gc.isenabled() and gc.get_freeze_count() == 0


@pytest.mark.parametrize("how", ["inactive", "caller_turned_it_off"])
def test_a_pause_leaves_the_collector_alone_when_inactive_or_already_off(how):
    if how == "caller_turned_it_off":
        gc.disable()
    with setup_gc.paused_for_setup(active=how == "caller_turned_it_off"):  # active, but already off
        setup_gc.setup_done()  # not our pause: no collection, no freeze, no re-enabling
        assert gc.isenabled() == (how == "inactive")
        assert gc.get_freeze_count() == 0
    assert gc.isenabled() == (how == "inactive")


def test_a_nested_pause_is_the_outer_ones():
    with setup_gc.paused_for_setup():
        with setup_gc.paused_for_setup():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block's end did not turn it back on
        setup_gc.setup_done()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_freeze_at_exit_registers_gc_freeze_once(monkeypatch):
    registered = []
    monkeypatch.setattr(setup_gc.atexit, "register", registered.append)
    monkeypatch.setitem(setup_gc._exit_freeze, "registered", False)
    setup_gc.freeze_at_exit()
    setup_gc.freeze_at_exit()  # validate called twice in one process (a test, a pipeline)
    assert registered == [gc.freeze]
    assert gc.get_freeze_count() == 0  # nothing frozen before the interpreter exits
