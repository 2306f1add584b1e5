"""The contract between the runtime and a framework integration.

The runtime (:mod:`torchpass.core.runtime`) knows nothing about DeepSpeed,
Megatron or TorchTitan. Each integration, the plain-PyTorch API included,
implements :class:`StateProvider`; the runtime calls it at the points of the
migration protocol listed on each method.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

from .topology import Layout

__all__ = ["ResumingProvider", "StateProvider", "SmallStateProvider", "SMALL_CLASS"]

SMALL_CLASS = "small"
"""The state class of per-rank small state (RNG streams, data position), which the runtime adds itself."""


@runtime_checkable
class StateProvider(Protocol):
    """What a framework integration tells the runtime about one rank."""

    def layout(self) -> Layout:
        """The job's parallel layout, read from the framework's own objects (called once, at attach)."""
        ...

    def state_components(self) -> tuple[dict[str, Any], dict[str, str]]:
        """This rank's state as ``(component -> state dict, component -> state class)``.

        Tensors must be the live ones (no copies): the runtime serves them to
        receivers while the rank waits in recovery, and receives into them.
        """
        ...

    def load_components(self, components: Mapping[str, Any], *, joining: bool) -> None:
        """Install received components (only those whose class was fetched).

        ``joining`` is True on a spare, whose process groups are still local: the
        moment to replay set-up decisions survivors made long ago (DDP buckets).
        """
        ...

    def discard_step(self) -> None:
        """Undo what an interrupted step left behind: partial gradients, framework per-step state.

        Called on every surviving rank before it reports, so the rank's state is
        exactly the state at its last version.
        """
        ...


class ResumingProvider(StateProvider, Protocol):
    """Optional: work that needs the new generation's live process groups.

    ``resume()`` runs on every member, survivors and joined spares alike, after
    the groups are rebuilt and the members have met at a barrier, before the
    step is re-executed. Collectives are allowed and must be the same on every
    rank. A provider whose layout declares derived state classes
    (:attr:`~torchpass.core.topology.StateClass.derived`) must recompute them
    here, from the rest of the state it loaded or kept (e.g. re-gathering the
    parameters a ZeRO optimizer derives from its partitions): the protocol
    never moved them, so until then they may be stale, partly updated, or a
    spare's initial values.
    """

    def resume(self) -> None:
        ...


class SmallStateProvider(StateProvider, Protocol):
    """Optional: per-rank small state beyond the global RNG streams and the data position.

    Megatron's model-parallel RNG tracker is the example: a few KB that differ
    across tensor-parallel ranks. The runtime mirrors it with the rest of the
    rank's small state (at step start and when the backward begins), keeps it in
    snapshots and buddy copies, and hands it back to whoever takes the rank over.
    Tensors in it must be CPU tensors; it is pickled.
    """

    def small_state(self) -> Any:
        ...

    def load_small_state(self, state: Any) -> None:
        ...
