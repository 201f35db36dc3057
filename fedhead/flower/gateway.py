"""The SuperLink's port for SuperNodes: Flower's Fleet API and nothing else.

Flower 1.42 serves its Control API (``flwr run``, ``flwr supernode register``, without authentication), its Runtime
API (the ServerApp's processes) and its Fleet API (SuperNodes) on one HTTP port; its ``--control-api-address`` and
``--fleet-api-address`` are deprecated and move nothing. ``fedhead flower superlink`` therefore binds Flower's port
on loopback (``--control-api-address``) and runs this gateway on ``--host``/``--port``: it forwards ``POST
/v1/fleet/<name>`` to that port and answers 404 to any other method, path or query, so a machine that reaches the
nodes' port reaches the Fleet API alone. Flower's SuperNode authentication still decides who joins: the nodes' signed
headers pass through unchanged. Bodies stream both ways (nothing is held in memory); the client's address goes
upstream as ``X-Forwarded-For`` (Flower's uvicorn trusts it from 127.0.0.1 only), replacing any the client sent.

Run by ``fedhead flower superlink``: ``python -m fedhead.flower.gateway --listen HOST:PORT --upstream HOST:PORT
[--ssl-certfile F --ssl-keyfile F --ssl-ca-certfile F]``; nothing here imports torch."""

from __future__ import annotations

import argparse
import re
import ssl

FLEET_PATH = re.compile(r"/v1/fleet/[a-z][a-z-]{0,63}")  # Flower's Fleet routes: /v1/fleet/register-node, ...
# hop-by-hop headers and those the gateway sets itself (RFC 9110 7.6.1; the client's forwarding claims)
DROPPED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"forwarded",
        b"x-forwarded-for",
        b"x-forwarded-host",
        b"x-forwarded-proto",
        b"x-real-ip",
    }
)
RESPONSE_DROPPED = DROPPED | {b"server", b"date"}  # the gateway's uvicorn writes its own date


def fleet_only(method: str, path: str, query: bytes) -> bool:
    """Whether a request may pass: a POST to one of the Fleet API's routes, without a query."""
    return method == "POST" and not query and FLEET_PATH.fullmatch(path) is not None


class FleetGateway:
    """The ASGI app: Fleet requests to ``upstream`` (``http(s)://HOST:PORT``), 404 to everything else."""

    def __init__(self, upstream: str, verify: ssl.SSLContext | bool):
        self.upstream, self.verify, self.client = upstream, verify, None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})

    async def _lifespan(self, receive, send) -> None:
        import httpx

        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.client = httpx.AsyncClient(
                    base_url=self.upstream,
                    verify=self.verify,
                    timeout=httpx.Timeout(600.0, connect=10.0),
                    limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
                    trust_env=False,  # no proxy from the environment between the gateway and the SuperLink
                )
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope, receive, send) -> None:
        import httpx

        path = scope["path"]
        if not fleet_only(scope["method"], path, scope.get("query_string", b"")):
            await _plain(send, 404, b"Not Found: this port carries the Fleet API alone\n")
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in DROPPED]
        if scope.get("client"):
            headers.append((b"x-forwarded-for", scope["client"][0].encode("latin-1")))

        async def body():
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise ConnectionError("the client went away")
                yield msg.get("body", b"")
                if not msg.get("more_body"):
                    return

        try:
            resp = await self.client.send(self.client.build_request("POST", path, headers=headers, content=body()),
                                          stream=True)  # fmt: skip
        except (httpx.HTTPError, ConnectionError):
            await _plain(send, 502, b"Bad Gateway: the SuperLink did not answer\n")
            return
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": resp.status_code,
                    "headers": [(k, v) for k, v in resp.headers.raw if k.lower() not in RESPONSE_DROPPED],
                }
            )
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.HTTPError:
            pass  # the upstream broke off mid-answer: uvicorn closes the client's connection
        finally:
            await resp.aclose()


async def _plain(send, status: int, text: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(text)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": text, "more_body": False})


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m fedhead.flower.gateway", description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", required=True, help="HOST:PORT the SuperNodes connect to")
    ap.add_argument("--upstream", required=True, help="HOST:PORT of Flower's SuperLink (loopback)")
    ap.add_argument("--ssl-certfile")
    ap.add_argument("--ssl-keyfile")
    ap.add_argument("--ssl-ca-certfile", help="the CA that signed the SuperLink's certificate (to reach it)")
    args = ap.parse_args(argv)
    host, port = _host_port(args.listen)
    up_host, up_port = _host_port(args.upstream)
    up_host = f"[{up_host}]" if ":" in up_host else up_host
    if args.ssl_certfile:
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=args.ssl_ca_certfile)
        upstream = f"https://{up_host}:{up_port}"
    else:
        verify, upstream = False, f"http://{up_host}:{up_port}"
    uvicorn.run(
        FleetGateway(upstream, verify),
        host=host,
        port=port,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        lifespan="on",
        access_log=False,
        proxy_headers=False,  # the client's own address, never one it claims
        server_header=False,
        log_level="info",
    )


if __name__ == "__main__":
    main()
