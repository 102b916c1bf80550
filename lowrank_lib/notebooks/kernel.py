"""The kernel client papermill runs notebooks with: one that cannot wait forever for a reply that has arrived.

Seen on 2026-12-03 (ipykernel 7.4.0, jupyter_client 8.10.0, nbclient 0.11.0, pyzmq 27.3.0): two papermill runs in two
pytest workers on the 2-core VM sat idle for minutes, each kernel idle with its cell executed, each client waiting in
``shell_channel.get_msg(timeout=None)``. Read from inside the hung client (gdb), its shell DEALER socket reported
``ZMQ_EVENTS = POLLIN | POLLOUT``: the ``execute_reply`` had been received into the socket, but the asyncio loop never
saw the socket's edge-triggered file-descriptor wake-up, and with no timeout nothing ever looked again. The same class
of lost wake-up is ipykernel's issue 1554 on the kernel side. A CI run of f1c9295 stopped the same way at 1211 of 1225
tests (killed at its 5400 s limit).

pyzmq's asyncio ``poll`` with a timeout checks the socket's level (``zmq_poll`` with timeout 0) when its timer fires,
so a message that is already there is found. :class:`PollingChannel` therefore turns a wait without a timeout into
waits of :data:`POLL_S` seconds, repeated until a message comes: the same messages in the same order, at most
``POLL_S`` late where a wake-up was lost, and the client never waits on the edge alone. Passing
``kernel_manager_class=PollingKernelManager`` to ``papermill.execute_notebook`` (nbclient's own option) is all it
takes; nothing else of papermill or nbclient changes.
"""
from __future__ import annotations

from queue import Empty

from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.manager import AsyncKernelManager
from traitlets import DottedObjectName, Type

#: seconds between level checks of a channel that waits without a timeout
POLL_S = 1.0


class PollingChannel(AsyncZMQSocketChannel):
    """``get_msg(timeout=None)`` as repeated ``get_msg(POLL_S)``; a finite timeout is passed through unchanged."""

    async def get_msg(self, timeout: float | None = None) -> dict:  # type: ignore[override]
        if timeout is not None:
            return await super().get_msg(timeout)
        while True:
            try:
                return await super().get_msg(POLL_S)
            except Empty:
                continue


class PollingKernelClient(AsyncKernelClient):
    """nbclient's async kernel client with :class:`PollingChannel` for the channels it waits on."""

    shell_channel_class = Type(PollingChannel)
    iopub_channel_class = Type(PollingChannel)
    control_channel_class = Type(PollingChannel)


class PollingKernelManager(AsyncKernelManager):
    """The async kernel manager whose clients are :class:`PollingKernelClient` s."""

    client_class = DottedObjectName("lowrank_lib.notebooks.kernel.PollingKernelClient")
    client_factory = Type(PollingKernelClient, klass="jupyter_client.asynchronous.AsyncKernelClient")
