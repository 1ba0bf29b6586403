"""How the simulated engine turns text into tokens: a contract between the simulator
(kubellm.engine.sim_*), which tokenizes with it, and the gateway, which must hash a prompt
to the same blocks to route precisely (spec.routing.prefixIndex precise) over simulated
replicas (`--tokenizer MODEL=simulator`). Nothing here is a real model's tokenizer.

- `ApproxTokens`: the UTF-8 text cut into 4-byte pieces (about 4 characters of English,
  what BPE tokenizers average), each read as a little-endian number folded into a prime
  vocabulary, so equal prefixes give equal token ids; cheap and stable across processes.
- `render_chat`: the simulator's chat template, one `<s>ROLE\\nCONTENT</s>\\n` per message
  and `<s>assistant\\n` as the generation prompt (text parts of list contents joined).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

CHARS_PER_TOKEN = 4


class ApproxTokens:
    """4 bytes of UTF-8 per token (the last piece zero-padded); stable ids."""

    vocab_size = 50_021  # prime, so ids spread over the whole vocabulary

    def encode(self, text: str) -> list[int]:
        data = text.encode()
        data += b"\0" * (-len(data) % CHARS_PER_TOKEN)
        return [value % self.vocab_size for (value,) in struct.iter_unpack("<I", data)]


def message_text(content: Any) -> str:
    """A message's content as the simulator reads it (OpenAI content parts: the text ones)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    """The simulator's chat template applied to well-formed `messages` (role, content)."""
    parts = [f"<s>{m['role']}\n{message_text(m.get('content'))}</s>\n" for m in messages]
    return "".join(parts) + "<s>assistant\n"
