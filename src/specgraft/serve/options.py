"""What a client may choose (``specgraft serve --methods / --max-budget / --client-options``, docs/serving.md).

A request picks its method, budget, verification rule and sampling fields; everything else that shapes a
drafter is the server's. By default a client may

- choose ``method`` among the server's ``--methods`` (the drafters built at start-up, so no request ever loads
  a model, a head or a calibration on the engine thread),
- set ``budget`` from 0 to ``--max-budget`` (a budget bounds the tree the one batched forward verifies and the
  draft forwards a step runs), or ``"auto"`` for the default method of a server started with ``--budget auto``
  (resolved at start-up: elsewhere it would measure latency curves on the engine thread),
- set ``verify`` (an opt-in lossy rule) and the sampling fields,

and never a method option (``options``): those hold paths on the server (``head``, ``calibration``,
``matrix``, ``model``) and table or tree sizes (``k``, ``top_k``, ``depth``) whose cost the server cannot bound.
``--client-options KEY,KEY`` lets clients set those keys (values still checked per method);
``--client-options all`` trusts clients with every option (the engine then caches at most
``engine.MAX_DRAFTERS`` drafters, and a build that failed is not retried).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SpecgraftError
from ..registry import DEFAULTS, REFERENCES

# The loop's methods the server can run (the outside references run their library's own loop).
SERVABLE = tuple(m for m in DEFAULTS if m not in REFERENCES)
DEFAULT_MAX_BUDGET = 128


@dataclass
class ClientPolicy:
    methods: tuple[str, ...] = SERVABLE
    max_budget: int = DEFAULT_MAX_BUDGET
    option_keys: frozenset[str] | None = field(default_factory=frozenset)  # None: every option (trusted)
    strict: bool = False  # methods named by the operator must all build; the default list keeps those that do

    @classmethod
    def parse(cls, methods: str | None, max_budget: int, client_options: str | None) -> "ClientPolicy":
        """From the CLI's strings: ``methods`` comma-separated (None: every servable method), ``client_options``
        a comma-separated key list, ``all`` or ``none`` (None: none)."""
        if max_budget < 0:
            raise SpecgraftError(f"--max-budget must be >= 0, got {max_budget}")
        names = SERVABLE if methods is None else tuple(m.strip() for m in methods.split(",") if m.strip())
        bad = [m for m in names if m not in SERVABLE]
        if bad or not names:
            raise SpecgraftError(f"--methods: unknown or unservable method(s) {bad}; choose from {', '.join(SERVABLE)}")
        text = (client_options or "none").strip()
        if text == "all":
            keys = None
        elif text == "none":
            keys = frozenset()
        else:
            keys = frozenset(k.strip() for k in text.split(",") if k.strip())
            known = {k for m in DEFAULTS.values() for k in m} - {"budget"}
            if keys - known:
                raise SpecgraftError(f"--client-options: unknown option(s) {sorted(keys - known)}")
        return cls(names, max_budget, keys, strict=methods is not None)

    def check(self, method: str, budget, options: dict, auto_ready: bool = False) -> None:
        """Refuse what this policy does not let a client choose (SpecgraftError: a 400 naming the field).
        ``auto_ready``: this method's ``budget="auto"`` was resolved at start-up."""
        if method not in self.methods:
            raise SpecgraftError(f"method '{method}' is not enabled on this server; it runs: {', '.join(self.methods)}")
        if isinstance(budget, int) and not 0 <= budget <= self.max_budget:
            raise SpecgraftError(f"budget must be between 0 and {self.max_budget} on this server, got {budget}")
        if budget == "auto" and not auto_ready and self.option_keys is not None:
            raise SpecgraftError("budget 'auto' is resolved at start-up for the server's default method only "
                                 "(start it with --budget auto); send an integer budget")
        if self.option_keys is not None:
            refused = sorted(set(options) - self.option_keys)
            if refused:
                raise SpecgraftError(f"options {refused} are set by the server, not by clients "
                                     "(the server's --client-options lists what clients may set)")

    def describe(self) -> dict:
        return {"methods": list(self.methods), "max_budget": self.max_budget,
                "client_options": "all" if self.option_keys is None else sorted(self.option_keys)}
