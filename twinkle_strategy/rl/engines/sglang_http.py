"""An SGLang server (``python -m sglang.launch_server``) as the engine of
:class:`~twinkle_strategy.rl.engines.sglang_distributed.SGLangDistributedReceiver`: its weight-update endpoints
behind the ``sglang.Engine`` methods of the same names, with the standard library's HTTP client (no SGLang needed on
the trainer). The server answers ``{"success": bool, "message": str}`` (status 400 when refused); ``/flush_cache``
answers text (400 when it did not flush)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


class SGLangHTTPEngine:
    """``url``: the server's base address (``http://host:30000``); ``api_key``: its admin key, if it has one."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 600.0):
        self.url, self.api_key, self.timeout_s = url.rstrip("/"), api_key, timeout_s

    def _post(self, path: str, body: dict | None) -> tuple[bool, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body or {}).encode(), headers=headers,
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            status, text = error.code, error.read().decode()
        try:
            answer = json.loads(text)
        except ValueError:
            return status == 200, text.strip()
        return bool(answer.get("success", status == 200)), str(answer.get("message", ""))

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "nccl") -> tuple[bool, str]:
        return self._post("/init_weights_update_group", dict(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset, world_size=world_size,
            group_name=group_name, backend=backend))

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True) -> tuple[bool, str]:
        return self._post("/update_weights_from_distributed", dict(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=flush_cache))

    def flush_cache(self) -> tuple[bool, str]:
        return self._post("/flush_cache", None)
