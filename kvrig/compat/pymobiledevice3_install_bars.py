"""pymobiledevice3's install progress bars: `InstallationProxyService.install_from_local` draws its upload and
install bars through installation_proxy's module-level `ProgressBar`, with no switch of its own. Importing this
module rebinds that name to a bar that is disabled (pymobiledevice3's own way to draw none) while the task's
`INSTALL_BARS` is False (`kvrig -q` and `--json`): per task, so phones installing side by side in one lab process
each follow the command that started them."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from pymobiledevice3.progress import ProgressBar
from pymobiledevice3.services import installation_proxy

DISTRIBUTION = "pymobiledevice3"
TESTED = ">=11.45,<12"

INSTALL_BARS: ContextVar[bool] = ContextVar("kvrig_install_bars", default=True)


def _install_bar(*args: Any, **kwargs: Any) -> ProgressBar:
    return ProgressBar(*args, **{**kwargs, "disable": bool(kwargs.get("disable")) or not INSTALL_BARS.get()})


installation_proxy.ProgressBar = _install_bar  # type: ignore[misc,assignment]
