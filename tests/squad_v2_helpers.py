"""Small SQuAD v2.0 files for tests, made from the shared v1.1 dev set (../shared/data has no v2.0).

Every `every`-th question of each paragraph is marked `is_impossible` with no answers (its v1.1 answers
become `plausible_answers`, as in the real v2.0 files); the rest keep their answers.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def write_squad_v2(
    shared_data: Path, folder: Path, *, every: int = 3, max_articles: int | None = None, gzipped: bool = False
) -> set[str]:
    """Write `<folder>/dev-v2.0.json` (or `.json.gz`) from the first `max_articles` articles of the v1.1
    dev set. -> the ids of the questions marked unanswerable."""
    with gzip.open(shared_data / "squad" / "dev-v1.1.json.gz", "rt", encoding="utf-8") as file:
        document = json.load(file)
    articles = document["data"][:max_articles]
    impossible: set[str] = set()
    for article in articles:
        for paragraph in article["paragraphs"]:
            for index, question in enumerate(paragraph["qas"]):
                question["is_impossible"] = index % every == every - 1
                if question["is_impossible"]:
                    question["plausible_answers"] = question.pop("answers")
                    question["answers"] = []
                    impossible.add(question["id"])
    folder.mkdir(parents=True, exist_ok=True)
    payload = json.dumps({"version": "v2.0", "data": articles})
    if gzipped:
        with gzip.open(folder / "dev-v2.0.json.gz", "wt", encoding="utf-8") as file:
            file.write(payload)
    else:
        (folder / "dev-v2.0.json").write_text(payload, encoding="utf-8")
    return impossible
