set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 420 python3 -m pdd.cli bench frontdoor --routers 1,2 --workers 2 --concurrency 64,256,1024 --duration 10 --warmup 3 --client-procs 8 --json $OUT/fd1.json 2>&1 | tail -30
for f in /tmp/pdd-bench-frontdoor/routers-*/router*.log; do echo "== $f"; grep -v " INFO " $f | tail -8; done
