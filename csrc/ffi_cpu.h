#pragma once
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxGinCpuAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxGinCpuAllReduceStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxGinCpuAllReduceDone);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxGinCpuAddRmsNorm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxGinCpuCollective);
