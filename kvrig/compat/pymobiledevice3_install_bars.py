"""pymobiledevice3's install progress bars: `InstallationProxyService.install_from_local` draws its upload and
install bars through installation_proxy's module-level `ProgressBar`, with no switch of its own. Importing this
module rebinds that name to a bar that is disabled (pymobiledevice3's own way to draw none) while the task's
`INSTALL_BARS` is False (`kvrig -q` and `--json`): per task, so phones installing side by side in one lab process
each follow the command that started them. A bar whose block ends without an error ends full: installd's last
PercentComplete is 90 before its Complete status, which left a finished install drawn at 90 %."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from pymobiledevice3.progress import ProgressBar
from pymobiledevice3.services import installation_proxy

DISTRIBUTION = "pymobiledevice3"
TESTED = ">=11.45,<12"

INSTALL_BARS: ContextVar[bool] = ContextVar("kvrig_install_bars", default=True)


class _FinishingBar(ProgressBar):
    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if exc_type is None and self._total is not None:  # pinned internals: the bar's total
            self.n = self._total
        super().__exit__(exc_type, exc_val, exc_tb)


def _install_bar(*args: Any, **kwargs: Any) -> ProgressBar:
    return _FinishingBar(*args, **{**kwargs, "disable": bool(kwargs.get("disable")) or not INSTALL_BARS.get()})


installation_proxy.ProgressBar = _install_bar  # type: ignore[misc,assignment]
