"""An OpenAI streaming completion read as the tests and the device check read it: event by event."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator


def stream_completion(url: str, body: dict, timeout: float) -> Iterator[tuple[list[int], str | None]]:
    """POSTs `body` (streamed, with token ids) to `url`/v1/completions; yields each event's token ids and
    its error message (None when it has none). A failed connection or read raises."""
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({**body, "stream": True, "return_token_ids": True}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[len(b"data: ") :])
            error = ev["error"]["message"] if "error" in ev else None
            yield [t for c in ev.get("choices", []) for t in (c.get("token_ids") or [])], error
