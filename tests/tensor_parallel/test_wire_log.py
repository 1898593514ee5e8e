"""``record_wire_bytes``: every TP collective issued while the block is open is recorded,
from any thread (on CUDA, autograd runs the backward's collectives on its device thread),
into the innermost open log only, and nothing is recorded once it is closed."""

from __future__ import annotations

import threading

from hybrid_dist.tensor_parallel import record_wire_bytes
from hybrid_dist.tensor_parallel._comm import log_event


def _from_thread(*event) -> None:
    t = threading.Thread(target=log_event, args=event)
    t.start()
    t.join()


def test_events_from_other_threads_are_recorded():
    with record_wire_bytes() as log:
        log_event("all_gather", "rowwise", "fp8", 100)
        _from_thread("all_gather", "columnwise", "fp8", 50)
    _from_thread("all_gather", "rowwise", "fp8", 7)
    log_event("all_gather", "rowwise", "fp8", 7)
    assert [(e.what, e.nbytes) for e in log.events] == [("rowwise", 100), ("columnwise", 50)]
    assert log.total("all_gather") == 150 and log.total("all_gather", "columnwise") == 50


def test_nested_logs_record_into_the_innermost():
    with record_wire_bytes() as outer:
        log_event("reduce_scatter", "grad", "torch.bfloat16", 8)
        with record_wire_bytes() as inner:
            _from_thread("all_reduce", "amax", "float32", 4)
        log_event("all_gather", "rowwise", "fp8", 16)
    assert [e.nbytes for e in outer.events] == [8, 16]
    assert [e.nbytes for e in inner.events] == [4]
