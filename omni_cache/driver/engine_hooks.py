"""What omni-cache installs on a running vLLM-Omni engine (``Omni`` / ``AsyncOmni``) in the
process that drives it — one entry point for ``OmniPipeline``, ``StreamingPipeline``
(``omni-cache run``) and ``omni-cache serve``:

- the thinker's prefix-aware router (:mod:`omni_cache.driver.routing`), when stage 0's
  ``env:`` asks for it (``OMNI_CACHE_ROUTING: prefix``) and it runs > 1 replica;
- talker content identity (:mod:`omni_cache.driver.talker_identity`), when the talker stage
  runs with ``enable_prefix_caching: true`` — without it the talker shares no block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EngineHooks:
    """The hooks installed on one engine (``None``: not installed)."""

    router: Any = None
    talker_identity: Any = None

    def talker_hit(self, request_id: str) -> tuple[int, int]:
        """``(talker prefix-hit tokens, talker prompt tokens)`` of a finished request; ``(0, 0)``
        when talker identity is not installed or the talker produced nothing for it."""
        hit = self.talker_identity.pop_hit(request_id) if self.talker_identity is not None else None
        return hit or (0, 0)


def hooks_wanted(stage_config: Any) -> bool:
    """Whether ``stage_config`` (:class:`omni_cache.driver.stage_config.StageConfig`) asks for
    any hook: thinker routing, or prefix caching on a talker stage (stage 1)."""
    from omni_cache.driver.routing import THINKER_STAGE_ID, routing_config

    if routing_config(stage_config.stage(THINKER_STAGE_ID).get("env")) is not None:
        return True
    try:
        talker = stage_config.stage(1)
    except KeyError:
        return False
    return bool(talker.get("enable_prefix_caching", stage_config.raw.get("enable_prefix_caching", False)))


def prepare_environment() -> None:
    """What the hooks need in the environment the stage processes inherit; call it before the
    engine starts: the talker keys' signing secret (``OMNI_CACHE_TALKER_KEYS_SECRET``)."""
    from omni_cache.core.talker_keys import ensure_signing_secret

    ensure_signing_secret()


def install_engine_hooks(omni: Any, stage_config: Any) -> EngineHooks:
    """Install every hook ``stage_config`` asks for on the running ``omni``.

    Raises:
        omni_cache.driver.routing.RoutingSetupError: routing asked for, no thinker pool (or its
            tokenizer fails).
        omni_cache.driver.talker_identity.TalkerIdentitySetupError: the talker keys' vLLM-Omni
            helpers moved.
        omni_cache.settings.SettingError: a bad routing setting.
    """
    from omni_cache.driver.routing import install_routing_from_stage_config
    from omni_cache.driver.talker_identity import install_talker_identity

    return EngineHooks(router=install_routing_from_stage_config(omni, stage_config),
                       talker_identity=install_talker_identity(omni))
