"""Optional dependencies: one clear ImportError, with the command that installs them."""

from __future__ import annotations

TRANSFORMERS_INSTALL = 'pip install "flash_attn_tq[transformers]"'


def transformers_missing(what: str, cause: BaseException | None = None) -> ImportError:
    """The ImportError for ``what`` (a module or function written against transformers >= 5) when
    transformers, or a name it should have, could not be imported (``cause``)."""
    try:
        import transformers
    except ImportError:
        return ImportError(
            f"{what} needs transformers >= 5, which is not installed; install it with: {TRANSFORMERS_INSTALL}"
        )
    found = getattr(transformers, "__version__", "unknown version")
    return ImportError(
        f"{what} needs transformers >= 5 (found {found}{': ' + str(cause) if cause else ''}); "
        f"install it with: {TRANSFORMERS_INSTALL}"
    )


def require_transformers(what: str) -> None:
    """Raise :func:`transformers_missing`'s ImportError where transformers is not importable."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise transformers_missing(what, e) from e
