"""A run that opens connections to the agent until it is refused, from several processes (the first and its forked
children), each connection holding an event stream open; then it holds them all until it is stopped.

argv: SOCKET_PATH PROCESSES OUT_FILE. Each process appends one JSON line to OUT_FILE once refused:
{"pid", "held", "refusal": {code, message} (the raw frame), "typed": the class AgentClient raised on one more try}.
"""

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

sock_path, procs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for _ in range(procs - 1):
    if os.fork() == 0:
        break

held = []
refusal = None
while refusal is None and len(held) < 1000:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(sock_path)
    s.sendall(b'{"type":"hello","request_id":"h"}\n{"type":"get_events","request_id":"e","after_seq":999999999,"follow":true}\n')
    first = json.loads(s.makefile("rb").readline())
    if first.get("type") == "error":
        refusal = {"code": first["code"], "message": first["message"]}
        s.close()
    else:
        held.append(s)


async def one_more() -> str:
    from gpudeck.agents.wire.client import AgentClient

    try:
        c = await AgentClient.connect_unix(Path(sock_path), autostart=False)
    except Exception as exc:
        return type(exc).__name__
    await c.close()
    return "connected"


typed = asyncio.run(one_more())
with open(out, "a") as fh:
    fh.write(json.dumps({"pid": os.getpid(), "held": len(held), "refusal": refusal, "typed": typed}) + "\n")
while True:
    time.sleep(1)
