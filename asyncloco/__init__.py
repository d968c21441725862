"""asyncloco: asynchronous Local-SGD (Delayed Nesterov + Dynamic Local Updates) over hivemind."""

import logging as _logging

__version__ = "0.1.0"

# bitsandbytes (the int8/int4 codecs, 8-bit AdamW) tries, on CPUs with AVX512-BF16, to fetch an optional 4-bit GEMM
# kernel through the `kernels` package and warns when it is absent. asyncloco never runs 4-bit matmuls, so the
# notice is noise in every log; only that one message is dropped.
_BNB_KERNEL_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


def _not_the_bnb_kernel_notice(record: _logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_BNB_KERNEL_NOTICE)


_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_the_bnb_kernel_notice)
