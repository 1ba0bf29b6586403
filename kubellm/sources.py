"""Model sources (`spec.model.source`) and where an engine finds them.

One pure parser shared by the operator (which volume to mount), the engine
launcher (which path or Hugging Face id to give vLLM) and the local fleet.

Inside an engine pod the model volume is mounted at MODEL_ROOT:
- `pvc://claim/sub/path`: the PVC `claim` is mounted at MODEL_ROOT; the model is
  at MODEL_ROOT/sub/path.
- `file:///abs/path` (or `file://relative/path`, relative to the working
  directory): a path the pod or the laptop already has.
- `hf://org/name[@revision]`: downloaded by vLLM into HF_CACHE_DIR on the model
  volume (an emptyDir unless a PVC is given); HF_HUB_OFFLINE=1 is honoured.
- `s3://bucket/path`: fetched into MODEL_ROOT by an init step (not yet built).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MODEL_ROOT = "/models"
HF_CACHE_DIR = "/models/.hf-cache"
# Where the operator mounts the LLMDeployment (JSON) that the engine launcher reads.
SPEC_DIR = "/etc/kubellm"
SPEC_FILENAME = "llmdeployment.json"
SPEC_PATH = f"{SPEC_DIR}/{SPEC_FILENAME}"


@dataclass(frozen=True)
class ModelSource:
    scheme: Literal["hf", "pvc", "file", "s3"]
    location: str  # hf: org/name; pvc: claim; file: path; s3: bucket/path
    path: str = ""  # pvc: path inside the claim
    revision: str | None = None  # hf only

    def local_path(self, model_root: str = MODEL_ROOT) -> str | None:
        """The filesystem path the engine loads, or None for hf:// and s3:// sources."""
        if self.scheme == "file":
            return self.location
        if self.scheme == "pvc":
            return f"{model_root.rstrip('/')}/{self.path}".rstrip("/")
        return None


# Where the operator mounts adapter claims other than the model's (pvc://claim/path ->
# ADAPTER_ROOT/claim/path); an adapter on the model's own claim is read under MODEL_ROOT.
ADAPTER_ROOT = "/adapters"


def adapter_path(
    source: str, model_source: str, model_root: str = MODEL_ROOT, adapter_root: str = ADAPTER_ROOT
) -> str:
    """The path or Hugging Face id vLLM loads one adapter (`spec.adapters[].source`) from.

    Raises ValueError naming spec.adapters for what the engine cannot load: s3:// (no
    fetch step yet, as for models) and hf:// with a revision (vLLM's LoRA loader takes
    a repository id only)."""
    try:
        parsed = parse_source(source)
    except ValueError:
        raise ValueError(
            f"spec.adapters source {source!r} must start with hf://, pvc:// or file://"
        ) from None
    if parsed.scheme == "s3":
        raise ValueError(
            f"spec.adapters source {source!r}: s3:// sources are not supported yet; copy the "
            "adapter to a PVC and use pvc://claim/path"
        )
    if parsed.scheme == "hf":
        if parsed.revision:
            raise ValueError(
                f"spec.adapters source {source!r}: vLLM loads adapters by repository id only; "
                "drop the @revision or copy that revision to a PVC"
            )
        return parsed.location
    if parsed.scheme == "file":
        return parsed.location
    model = parse_source(model_source) if model_source.startswith("pvc://") else None
    if model is not None and model.location == parsed.location:
        return f"{model_root.rstrip('/')}/{parsed.path}".rstrip("/")
    return f"{adapter_root.rstrip('/')}/{parsed.location}/{parsed.path}".rstrip("/")


def parse_source(source: str) -> ModelSource:
    """Split a model source URI; raise ValueError naming spec.model.source when malformed."""
    scheme, sep, rest = source.partition("://")
    if not sep or not rest or scheme not in ("hf", "pvc", "file", "s3"):
        raise ValueError(
            f"spec.model.source {source!r} must start with hf://, pvc://, file:// or s3://"
        )
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise ValueError(f"spec.model.source {source!r}: expected hf://org/name[@revision]")
        return ModelSource("hf", repo, revision=revision or None)
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        return ModelSource("pvc", claim, path=path.strip("/"))
    return ModelSource(scheme, rest)  # type: ignore[arg-type]
