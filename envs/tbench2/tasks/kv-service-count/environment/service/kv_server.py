"""A tiny line-based key-value service: `GET key` answers the value (or an empty line),
`SET key value` stores it and answers OK. Seeded from seed.json."""

import asyncio
import json
from pathlib import Path

STORE = json.loads((Path(__file__).parent / "seed.json").read_text())


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while line := await reader.readline():
        words = line.decode().strip().split(" ", 2)
        if words[0] == "GET" and len(words) == 2:
            reply = STORE.get(words[1], "")
        elif words[0] == "SET" and len(words) == 3:
            STORE[words[1]] = words[2]
            reply = "OK"
        else:
            reply = "ERR"
        writer.write(reply.encode() + b"\n")
        await writer.drain()
    writer.close()


async def main() -> None:
    server = await asyncio.start_server(handle, "0.0.0.0", 7000)
    async with server:
        await server.serve_forever()


asyncio.run(main())
