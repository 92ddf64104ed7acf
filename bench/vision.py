"""Images in: an image's first token on kronk and on llama-server, on the same two files, side by side.

    python bench/run.py --vision [--rounds 7] [--llama-server PATH]

The medium demo model (512 wide, 8 layers) and a projector of LLaVA 1.5's shape at a quarter of its width (336
pixels, 14-pixel patches: 576 image tokens; 4 blocks 256 wide), random weights: the work is real, the replies
gibberish. Both servers run at once (one slot, two threads); each round sends each a new image (its own noise)
and then the same prompt again, llama-server's /completion with multimodal_data on both, order reversed every
other round. Medians over the rounds: the first token after a new image (decode, encode, prefill), after the
same image again (its prefix cached), and of the same prompt without the image.
"""

import base64
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Optional

import requests

from kronk_wsgi.engine.demo_model import SIZES, ProjectorSize, ensure_demo_model, write_demo_projector
from kronk_wsgi.testing import run_llama_server, run_server
from kronk_wsgi.testing.media_files import png

PROJECTOR = ProjectorSize(image=336, patch=14, width=256, layers=4, heads=4, feed_forward=1024)
TEXT = "Describe the picture in detail, then list what stands out. "


def first_token(url: str, image: Optional[bytes]) -> float:
    """Seconds to the first token of a greedy /completion of the prompt (with ``image`` before its text)."""
    prompt = {"prompt_string": "<__media__>" + TEXT, "multimodal_data": [base64.b64encode(image).decode()]} \
        if image is not None else TEXT
    started = time.perf_counter()
    reply = requests.post(url + "/completion", json={"prompt": prompt, "n_predict": 1, "temperature": 0,
                                                     "cache_prompt": True}, timeout=300)
    assert reply.status_code == 200, (url, reply.text[:300])
    return time.perf_counter() - started


def vision_side_by_side(rounds: int, llama_server: Optional[str], workdir: Path) -> list[tuple[str, str]]:
    model = ensure_demo_model("medium")
    projector = write_demo_projector(workdir / "mmproj-bench.gguf", SIZES["medium"].width, size=PROJECTOR)
    models = {"bench": {"path": str(model), "mmproj": str(projector), "context_length": 2048}}
    with contextlib.ExitStack() as stack:
        systems = {"kronk": stack.enter_context(run_server(workdir, {"KRONK_MODELS": json.dumps(models),
                                                                     "KRONK_THREADS": 2})).url}
        if llama_server:
            os.environ["LLAMA_MEDIA_MARKER"] = "<__media__>"  # llama-server's marker is random otherwise
            systems["llama-server"] = stack.enter_context(run_llama_server(
                llama_server, model, ["--mmproj", str(projector), "-np", "1", "-t", "2", "-c", "2048",
                                      "--no-webui", "--no-warmup"]))
        measured: dict[tuple[str, str], list[float]] = {}
        for round_ in range(rounds + 1):  # the first round warms up and is not counted
            image = png(640, 480, noise_seed=round_)
            for name in systems if round_ % 2 == 0 else reversed(systems):
                url = systems[name]
                times = {"new image": first_token(url, image), "same image again": first_token(url, image),
                         "no image": first_token(url, None)}
                if round_:
                    for what, seconds in times.items():
                        measured.setdefault((name, what), []).append(seconds)
    rows = []
    for what in ("new image", "same image again", "no image"):
        mine = statistics.median(measured[("kronk", what)])
        label = f"first token, {what}" + (f" ({PROJECTOR.tokens} image tokens)" if what != "no image" else "")
        if llama_server:
            theirs = statistics.median(measured[("llama-server", what)])
            rows.append((f"{label}: kronk / llama-server, ms",
                         f"{1000 * mine:.0f} / {1000 * theirs:.0f} = {mine / theirs:.2f}x"))
        else:
            rows.append((f"{label}, ms", f"{1000 * mine:.0f}"))
    return rows
