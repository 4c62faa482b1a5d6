"""`echo`: a deterministic CPU model that answers each user turn with the user's own audio."""

from plugins.echo.plugin import EchoPlugin, EchoRequest
from plugins.echo.stage import EchoStagePort

__all__ = ["EchoPlugin", "EchoRequest", "EchoStagePort"]
