"""Compat for verl 0.9.x's ``BucketedWeightSender``: a receiver that dies mid-update fails the sender in seconds.

verl's trainer-side sender (``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``) binds a ZMQ
``REQ`` socket and waits in a blocking ``socket.recv()`` (no timeout, inside the event loop of the worker that
sends) for the vLLM worker's acknowledgement of every bucket. When the vLLM worker process dies mid-update
(killed, out of memory, a crash in a kernel) no acknowledgement ever comes and the trainer waits forever: the
RPC future that would report the worker's death is awaited only after the sender returns.

:func:`install` wraps the sender's socket (``BucketedWeightSender._init_socket``) so that each acknowledgement is
waited for in short polls while a ZMQ socket monitor watches the connection: when the receiver's end of the IPC connection disconnects (the OS closes it when the process dies),
the sender raises :class:`WeightReceiverLostError` naming the socket and how far the update got. A live receiver
that takes long to load a bucket is waited for as before (no timeout). A receiver that never connects (the update
RPC failed on vLLM's side before it opened the socket, or the worker is gone) is waited for at most
``VERL_MTP_SYNC_RECV_TIMEOUT_S`` (default 300 s, the time the receiver waits for each bucket): then the same error
says no worker connected. Installed in every process that imports
the plugin after verl (:func:`verl_mtp_plugin.engine.registry.register`), i.e. the trainer's workers that send.
:func:`probe` checks at start-up that verl still has what the wrapper relies on. ``_cleanup`` is wrapped too: with
the shared-memory transport the dead receiver's resource tracker may have unlinked the segment already, and verl's
clean-up (in ``finally``) would replace the real error by a ``FileNotFoundError``. These two private methods are all
this module touches.
"""

from __future__ import annotations

import logging
import os
import time

from verl_mtp_plugin.config_keys import ENV_SYNC_RECV_TIMEOUT as RECV_TIMEOUT_ENV

__all__ = ["POLL_MS", "WeightReceiverLostError", "install", "installed", "probe"]

logger = logging.getLogger(__name__)

#: how often the sender looks at the connection while it waits for an acknowledgement
POLL_MS = 200
_MARK = "_verl_mtp_receiver_watch"


#: how long the sender waits for a receiver to connect without ``VERL_MTP_SYNC_RECV_TIMEOUT_S`` (the receiver's own
#: wait for each bucket has the same default)
DEFAULT_CONNECT_TIMEOUT_S = 300.0


def connect_timeout_s() -> float:
    """Seconds the sender waits for a receiver to connect: ``VERL_MTP_SYNC_RECV_TIMEOUT_S`` (checked at start-up),
    else :data:`DEFAULT_CONNECT_TIMEOUT_S`."""
    try:
        value = float(os.environ.get(RECV_TIMEOUT_ENV, "").strip() or DEFAULT_CONNECT_TIMEOUT_S)
    except ValueError:
        value = DEFAULT_CONNECT_TIMEOUT_S
    return value if value > 0 else DEFAULT_CONNECT_TIMEOUT_S


class WeightReceiverLostError(RuntimeError):
    """The vLLM worker receiving a weight update disconnected before acknowledging it (its process died)."""


class _WatchedReqSocket:
    """verl's REQ socket whose ``recv`` fails when the peer disconnects (everything else is passed through)."""

    def __init__(self, sock, handle: str):
        import zmq

        self._sock = sock
        self._handle = handle
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._peers = 0
        self._lost = 0
        self._acks = 0
        self._connected = False
        self._since = time.monotonic()
        self._connect_s = connect_timeout_s()
        self.lost_error: WeightReceiverLostError | None = None

    def _drain_events(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                self._peers += 1
                self._connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._peers -= 1
                self._lost += 1

    def _check(self, waiting_for: str) -> None:
        self._drain_events()
        if self._lost and self._peers <= 0:
            self.lost_error = WeightReceiverLostError(
                f"weight update aborted: the vLLM worker receiving it ({self._handle}) disconnected after "
                f"{self._acks} acknowledged message(s), {waiting_for}: its process died (killed, out of memory or "
                "crashed; its cause is in the vLLM worker's log). The rollout holds a partial update; restart the "
                "run (from the last checkpoint)"
            )
            raise self.lost_error
        if not self._connected and time.monotonic() - self._since > self._connect_s:
            self.lost_error = WeightReceiverLostError(
                f"weight update aborted: no vLLM worker connected to receive it ({self._handle}) within "
                f"{self._connect_s:.0f} s ({RECV_TIMEOUT_ENV}): the update call failed on vLLM's side before it "
                "opened the socket, or the worker is gone (its cause is in the vLLM worker's log); restart the run "
                "(from the last checkpoint)"
            )
            raise self.lost_error

    def recv(self, *args, **kwargs):
        import zmq

        while True:
            if self._sock.poll(POLL_MS, zmq.POLLIN):
                out = self._sock.recv(*args, **kwargs)
                self._acks += 1
                return out
            self._check("before acknowledging the next")

    def _send(self, method: str, *args, **kwargs):
        # a REQ socket whose only peer is gone blocks in send (no pipe to queue into): wait for room in polls too
        import zmq

        while True:
            self._check("before the next message could be sent to it")
            if self._sock.poll(POLL_MS, zmq.POLLOUT):
                return getattr(self._sock, method)(*args, **kwargs)

    def send(self, *args, **kwargs):
        return self._send("send", *args, **kwargs)

    def send_pyobj(self, *args, **kwargs):
        return self._send("send_pyobj", *args, **kwargs)

    def close(self, *args, **kwargs):
        try:
            self._sock.disable_monitor()
        except Exception:  # noqa: BLE001 - already closed
            pass
        self._monitor.close(linger=0)
        return self._sock.close(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _sender_cls():
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    return BucketedWeightSender


def probe() -> list[str]:
    """What :func:`install` needs of verl, missing items named (empty: all there)."""
    try:
        cls = _sender_cls()
    except ImportError as e:
        return [f"verl.workers.rollout.vllm_rollout.bucketed_weight_transfer.BucketedWeightSender ({e})"]
    return [f"BucketedWeightSender.{n}" for n in ("_init_socket", "_cleanup", "async_send_weights")
            if not callable(getattr(cls, n, None))]


def installed() -> bool:
    try:
        return bool(getattr(_sender_cls()._init_socket, _MARK, False))
    except ImportError:
        return False


def install() -> bool:
    """Wrap ``BucketedWeightSender._init_socket`` (idempotent). Returns False where verl lacks the sender."""
    missing = probe()
    if missing:
        logger.warning("verl_mtp_plugin: weight-sender watch not installed; verl lacks %s", ", ".join(missing))
        return False
    cls = _sender_cls()
    if getattr(cls._init_socket, _MARK, False):
        return True
    original, original_cleanup = cls._init_socket, cls._cleanup

    def _init_socket(self):
        original(self)
        self.socket = self._verl_mtp_watch = _WatchedReqSocket(self.socket, self.zmq_handle)

    def _cleanup(self):
        # verl cleans up in ``finally``: with the shared-memory transport the dead receiver's resource tracker
        # may already have unlinked the segment, and that FileNotFoundError would replace the real error
        watch = getattr(self, "_verl_mtp_watch", None)
        try:
            return original_cleanup(self)
        except Exception as e:  # noqa: BLE001
            if watch is None or watch.lost_error is None:
                raise
            logger.warning("verl_mtp_plugin: weight sender clean-up after a lost receiver: %s: %s", type(e).__name__, e)

    for fn, orig in ((_init_socket, original), (_cleanup, original_cleanup)):
        setattr(fn, _MARK, True)
        fn.__wrapped__ = orig
    cls._init_socket, cls._cleanup = _init_socket, _cleanup
    return True


def uninstall() -> None:
    """Restore verl's ``_init_socket`` (tests)."""
    cls = _sender_cls()
    for name in ("_init_socket", "_cleanup"):
        fn = getattr(cls, name)
        if getattr(fn, _MARK, False):
            setattr(cls, name, fn.__wrapped__)
