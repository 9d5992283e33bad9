"""Text from workers (error files, exception messages) made safe for a terminal."""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with control characters shown, not obeyed: an ANSI escape sequence in
    an error message cannot clear the screen or set the window title. Tabs stay;
    newlines stay when ``keep_newlines`` (else shown as ``\\n``)."""
    out = []
    for ch in text:
        code = ord(ch)
        if (
            ch == "\t"
            or (ch == "\n" and keep_newlines)
            or 32 <= code < 127
            or (code >= 160 and code not in (0x2028, 0x2029))
        ):
            out.append(ch)
        elif ch == "\n":
            out.append("\\n")
        else:
            out.append(f"\\x{code:02x}" if code < 256 else f"\\u{code:04x}")
    return "".join(out)
