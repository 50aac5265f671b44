"""DetokenizeManager (chapter 13): token ids back to text, a few characters at a time, with stop
strings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from transformers import PreTrainedTokenizerBase

from minisgl.message import DetokenizeMsg, FinishOrError, UserReply

INCOMPLETE = "\ufffd"  # what decode() gives for the first bytes of a character still to come


@dataclass
class DecodeStatus:
    """One request's output. ids[surr_offset:read_offset] were decoded last time, and text ends
    with their text; sent_offset characters of text have gone to the client."""

    prompt_tokens: int
    stop: list[str]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    surr_offset: int = 0
    read_offset: int = 0
    sent_offset: int = 0
    stopped: bool = False  # a stop string ended it; the scheduler's last tokens are dropped


class DetokenizeManager:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.status: dict[int, DecodeStatus] = {}

    def add(self, uid: int, prompt_tokens: int, stop: list[str]) -> None:
        self.status[uid] = DecodeStatus(prompt_tokens, [s for s in stop if s])

    def detokenize(self, msg: DetokenizeMsg) -> tuple[UserReply | None, bool]:
        """The reply for one new token (None: nothing to say), and whether the scheduler must
        abort the request (a stop string ended it before the scheduler did)."""
        s = self.status.get(msg.uid)
        if s is None:  # unknown, or already answered and forgotten
            return None, False
        if msg.finished:
            del self.status[msg.uid]
        if msg.error is not None:
            return self._reply(msg.uid, s, "", "error", error=msg.error), False
        if s.stopped:
            return None, False
        if msg.next_token >= 0:
            s.ids.append(msg.next_token)
        self._decode(s, final=msg.finished)
        text, cut = self._cut_at_stop(s)
        if cut:
            s.stopped = True
            if not msg.finished:
                self.status[msg.uid] = s  # kept until the scheduler's last message
            return self._reply(msg.uid, s, text, "stop"), not msg.finished
        if not msg.finished:
            return (UserReply(msg.uid, incremental_output=text, finished=False) if text
                    else None), False
        return self._reply(msg.uid, s, text, msg.finish_reason or "stop"), False

    def _decode(self, s: DecodeStatus, final: bool) -> None:
        """Extend s.text by the new tokens' text, unless it ends in an incomplete character:
        then wait for the next token (at the end, decode everything as it is)."""
        if final:
            s.text = cast(str, self.tokenizer.decode(s.ids, skip_special_tokens=True))
            return
        # one list of ids decodes to one str (decode's type also covers a batch of lists)
        before = cast(str, self.tokenizer.decode(s.ids[s.surr_offset:s.read_offset],
                                                 skip_special_tokens=True))
        now = cast(str, self.tokenizer.decode(s.ids[s.surr_offset:], skip_special_tokens=True))
        if len(now) > len(before) and not now.endswith(INCOMPLETE):
            s.text += now[len(before):]
            s.surr_offset, s.read_offset = s.read_offset, len(s.ids)

    def _cut_at_stop(self, s: DecodeStatus) -> tuple[str, bool]:
        """The text to send now, and whether a stop string was found. The output ends before
        the first stop string, which may span tokens; a tail that could still become one is
        held back, so a client never sees part of a stop string."""
        longest = max((len(x) for x in s.stop), default=0)
        start = max(0, s.sent_offset - longest + 1)  # earlier text was searched already
        hits = [i for i in (s.text.find(x, start) for x in s.stop) if i >= 0]
        if hits:
            end, cut = min(hits), True
        else:
            end, cut = len(s.text), False
            for n in range(min(longest - 1, len(s.text)), 0, -1):
                if any(x.startswith(s.text[-n:]) for x in s.stop):
                    end -= n
                    break
        end = max(end, s.sent_offset)
        text, s.sent_offset = s.text[s.sent_offset:end], end
        return text, cut

    def _reply(self, uid: int, s: DecodeStatus, text: str, reason: FinishOrError,
               error: str | None = None) -> UserReply:
        if error is None and not s.stopped:  # the held-back tail of a finished output goes too
            text += s.text[s.sent_offset:]
            s.sent_offset = len(s.text)
        return UserReply(uid, incremental_output=text, finished=True, finish_reason=reason,
                         prompt_tokens=s.prompt_tokens, completion_tokens=len(s.ids), error=error)
