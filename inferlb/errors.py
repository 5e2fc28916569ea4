"""The one exception root of inferlb, with structured fields.

Adapters map these to wire codes (HTTP status, gRPC status) at the edge; the core only raises them.
Modelled on python-hyper/h2's ``exceptions.py``: each error carries the fields that explain it, mapped to a
wire status only by the adapter.
"""

from __future__ import annotations


class InferlbError(Exception):
    """Root of every error inferlb raises on purpose."""


class ConfigError(InferlbError):
    """A config file or document was refused.

    Attributes:
        source: the file path (or ``"<string>"``) the config came from.
        problems: one ``(field, message)`` pair per problem; ``field`` is a dotted path such as
            ``models[0].versions[1].traffic_percent`` or ``""`` when the document as a whole is wrong.
    """

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        lines = [f"{source}: {field or '<document>'}: {msg}" for field, msg in problems]
        super().__init__("invalid config\n  " + "\n  ".join(lines))


class RequestError(InferlbError):
    """A client request refused before it reaches a backend, in OpenAI's error vocabulary.

    Attributes:
        status: HTTP status to answer with (400, 401, 404, 413, 429, ...).
        message: human-readable text for ``error.message``.
        type: OpenAI ``error.type`` (``invalid_request_error``, ``authentication_error``,
            ``rate_limit_error``, ...).
        code: OpenAI ``error.code`` (``model_not_found``, ``invalid_api_key``, ...) or None.
        param: the request field at fault (``model``, ``messages``), or None.
        retry_after_s: seconds for a ``retry-after`` header (429/503 only), or None.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,  # the OpenAI field is called "type"
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def to_openai_json(self) -> dict[str, object]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
