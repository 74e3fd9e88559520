"""RPC frames that decode but that no answer can be built from, on both ends of a real
loopback connection: the server answers with an error (a request whose id is not an
integer; a handler's result msgpack cannot pack) and goes on serving, the client
ignores a reply to no call of its own, and a peer's reply of the wrong shape is that
peer being unavailable. Before, an unsendable result, a reply whose id is unhashable
and a non-list answer to lookup or put each raised through the peer server's or a
client's task into mountd's nursery, and ended mountd."""
from __future__ import annotations

import functools

import pytest
import trio
import trio.testing

from mountd.cluster.peers import PeerSet
from quiverfs import wire
from quiverfs.rpc import RpcClient, RpcServer, Unavailable, _mac, client_handshake

SECRET = b"s" * 32


async def _echo(args: dict) -> object:
    return args.get("value")


async def _unsendable(args: dict) -> object:
    return {1, 2}  # a handler's bug: msgpack packs no set


async def _overflowing(args: dict) -> object:
    return 1 << 64  # a handler's bug: msgpack packs no int past u64


async def _serving(handlers: dict, nursery: trio.Nursery) -> int:
    server = RpcServer(SECRET, handlers)
    port = int(server.bind("127.0.0.1", 0, "--test").rsplit(":", 1)[1])
    await nursery.start(server.serve)
    return port


async def test_a_request_whose_answer_cannot_be_sent_gets_an_error_reply():
    async with trio.open_nursery() as nursery:
        port = await _serving({"echo": _echo, "unsendable": _unsendable,
                               "overflowing": _overflowing}, nursery)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await client_handshake(stream, SECRET)
            # only an integer id is echoed: a reply that echoes the id must be sendable
            await wire.send_msg(stream, {"id": [1], "op": "echo", "args": {"value": 7}})
            assert wire.unpack(await wire.recv_frame(stream)) == {
                "id": None, "ok": False, "error": "RpcError: a request's id must be an integer"}
            await wire.send_msg(stream, {"id": 2, "op": "unsendable", "args": {}})
            assert wire.unpack(await wire.recv_frame(stream)) == {
                "id": 2, "ok": False, "error": "internal error: reply"}
            await wire.send_msg(stream, {"id": 3, "op": "overflowing", "args": {}})
            assert wire.unpack(await wire.recv_frame(stream)) == {
                "id": 3, "ok": False, "error": "internal error: reply"}
            await wire.send_msg(stream, {"id": 4, "op": "echo", "args": {"value": 7}})
            assert wire.unpack(await wire.recv_frame(stream)) == {
                "id": 4, "ok": True, "result": 7}
        nursery.cancel_scope.cancel()


async def _answer_twice(stream: trio.SocketStream) -> None:
    """The server's side of a handshake, then to each request a reply whose id is a list
    (unhashable: no call's), and the right one."""
    async with stream:
        challenge = b"c" * 32
        await wire.send_msg(stream, {"challenge": challenge})
        hello = wire.unpack(await wire.recv_frame(stream))
        await wire.send_msg(stream, {"ok": True, "mac": _mac(SECRET, hello["challenge"],
                                                             b"server")})
        while True:
            request = wire.unpack(await wire.recv_frame(stream))
            await wire.send_msg(stream, {"id": [request["id"]], "ok": True, "result": 0})
            await wire.send_msg(stream, {"id": request["id"], "ok": True, "result": 1})


async def test_a_client_ignores_a_reply_whose_id_is_no_calls():
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(
            trio.serve_tcp, _answer_twice, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        client = RpcClient("127.0.0.1", port, SECRET, timeout=10.0)
        await nursery.start(client.tasks.run)
        assert [await client.call("any") for _ in range(2)] == [1, 1]  # one connection
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("reply", [5, {"a": 1}, [True], [True] * 3, None])
async def test_a_peers_reply_of_the_wrong_shape_is_the_peer_unavailable(reply):
    async def answer(args: dict) -> object:
        return reply

    async with trio.open_nursery() as nursery:
        port = await _serving({op: answer for op in ("lookup", "get", "put")}, nursery)
        peers = PeerSet(SECRET, trio.CapacityLimiter(1))
        await nursery.start(peers.tasks.run)
        peers.update({"b": f"127.0.0.1:{port}"})
        await trio.testing.wait_all_tasks_blocked()  # its client's task started
        for call in (lambda: peers.lookup("b", [b"\0" * 32] * 2),
                     lambda: peers.get_many("b", [b"\0" * 32] * 2),
                     lambda: peers.put_many("b", [(b"\0" * 32, b"x")] * 2)):
            with pytest.raises(Unavailable, match="peer b sent a malformed"):
                await call()
        nursery.cancel_scope.cancel()
