"""The strict tool-call requests of bench_structured_outputs.py --tool-calls 20, sent to mlx_lm.server at its
defaults (`python -m mlx_lm.server --model FOLDER`, as users run it) on SmolLM2 and Gemma 3.
Run: python peer_defaults_tool_calls.py SMOLLM2_FOLDER GEMMA3_FOLDER."""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]) + "/bench")
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]))
from served import Launch, serving  # noqa: E402
from bench_structured_outputs import tool_calls  # noqa: E402

for folder in sys.argv[1:]:
    launch = Launch("mlx_lm.server", (sys.executable, "-m", "mlx_lm.server", "--model", folder), None, False)
    with tempfile.TemporaryDirectory() as logs, serving(launch, Path(logs)) as url:
        print(f"{Path(folder).name}: mlx_lm.server at its defaults: {tool_calls(url, 20, 200)}", flush=True)
