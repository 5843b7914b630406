"""Harnesses only fastckpt's own tests use: a pass-through store to wrap (``wrapping``), a job
whose processes are threads (``threaded_job``), a man in the middle for the peer wire
(``peer_relay``), one chunk read from a peer (``peer_read``), frames tagged as a hostile peer
sends them (``tag_raw``). Import them as ``tests.support.<module>`` (the checkout's root on
``sys.path``, as ``python -m pytest`` from the root puts it).

What third parties test with too ships in :mod:`fastckpt.testing`.
"""
