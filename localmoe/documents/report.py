"""The result of one question over a set of documents, as Markdown or JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from localmoe.documents.citations import Citation
from localmoe.documents.records import FileProblem


@dataclass
class Report:
    question: str
    answer: str  # Markdown; verified citations as [n], rejected ones flagged [unverified]
    citations: list[Citation] = field(default_factory=list)  # verified, in order of [n]
    rejected: list[Citation] = field(default_factory=list)  # the model's citations that failed the check
    evidence: list[Citation] = field(default_factory=list)  # retrieved passages' closest sentences (checked)
    problems: list[FileProblem] = field(default_factory=list)
    mode: str = "long-context"  # or "map-reduce"; "retrieval" when no model was asked, "none" without text
    # "cited": checked citations; "uncited": the model cited nothing checkable, the evidence is shown as
    # uncited evidence; "not_found": no passage matches the question; "no_text": nothing could be read
    status: str = "cited"
    passages: dict[int, tuple[str, str]] = field(default_factory=dict)  # [P<id>] read -> (file, location)
    sources: list[str] = field(default_factory=list)
    budget: str = "high"
    stats: dict = field(default_factory=dict)  # seconds, pages, chunks, prompt/completion tokens

    def to_dict(self) -> dict:
        return {"question": self.question, "answer": self.answer, "status": self.status, "mode": self.mode,
                "budget": self.budget,
                "citations": [c.to_dict() for c in self.citations],
                "rejected_citations": [c.to_dict() for c in self.rejected],
                "evidence": [c.to_dict() for c in self.evidence],
                "passages": [{"id": i, "source": s, "location": loc} for i, (s, loc) in self.passages.items()],
                "problems": [{"path": str(p.path), "message": p.message} for p in self.problems],
                "sources": self.sources, "stats": self.stats}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=indent)

    def evidence_title(self) -> str:
        return "Evidence" if self.status == "cited" else "Uncited evidence"

    def evidence_note(self) -> str:
        """What the evidence list is: beside checked citations, or instead of them (labelled uncited)."""
        if self.status == "cited":
            return "Retrieved passages closest to the question (quotes checked against the source):"
        return ("The answer cites no passage that could be checked. Uncited evidence: the retrieved passages "
                "closest to the question (quotes checked against the source):")

    def to_markdown(self, level: int = 1) -> str:
        h = "#" * level
        lines = [f"{h} {self.question}", "", self.answer or "_(no answer)_", ""]
        if self.citations:
            lines += [f"{h}# Sources", ""] + [f"{i}. {c.label()}" for i, c in enumerate(self.citations, 1)] + [""]
        if self.evidence:
            lines += [f"{h}# {self.evidence_title()}", "", self.evidence_note(), ""]
            lines += [f"- {c.label()}" for c in self.evidence] + [""]
        if self.rejected:
            lines += [f"{h}# Rejected citations", ""]
            lines += [f"- P{c.passage}" + (f' "{c.quote}"' if c.quote else "") + f": {c.reason}"
                      for c in self.rejected] + [""]
        if self.problems:
            lines += [f"{h}# Problems", ""] + [f"- {p}" for p in self.problems] + [""]
        s = self.stats
        if s:
            lines.append(f"_{self.mode}, budget {self.budget}: {s.get('pages', 0)} pages, {s.get('chunks', 0)} "
                         f"passages ({s.get('passages_read', 0)} read), {s.get('seconds', 0):.1f} s_")
        return "\n".join(lines).rstrip() + "\n"
