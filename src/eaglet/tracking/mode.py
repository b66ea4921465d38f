"""Online or offline: W&B runs online when wandb itself has credentials for the server it is set up for.

wandb decides: WANDB_API_KEY (or an identity token file), the netrc entry of its server, or an api_key setting,
for the server of WANDB_BASE_URL or `wandb login --host` (a self-hosted one too). Nothing is verified, so the
check makes no network call. `wandb.login(prompt=False, verify=False)` answers the same question, but when it
finds credentials it asks the server who they belong to (to print it) and rewrites wandb's settings file.
"""

from __future__ import annotations

import os


def wandb_logged_in() -> bool:
    """Whether wandb has credentials for the server its settings point at."""
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth
    except ImportError:  # wandb before its wbauth module: the same lookup, through the older API
        import wandb

        return bool(wandb.api.api_key)
    settings = wandb_setup.singleton().settings
    host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
    auth = wbauth.authenticate_session(
        host=host, source="eaglet", prompt=False, update_session=False, verify=False
    )
    return auth is not None


def wandb_mode() -> str | None:
    """The mode to start W&B runs in: WANDB_MODE when set (online, offline, disabled), else offline without
    credentials; None leaves it to wandb (online).

    Passed to wandb.init as is rather than through the environment: wandb reads its environment once per
    process, so a WANDB_MODE set later (by this or by a test) would be ignored.
    """
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return None if wandb_logged_in() else "offline"
