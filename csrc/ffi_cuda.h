#pragma once
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxGinCudaAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxGinCudaAllReduceStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxGinCudaAllReduceDone);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxGinCudaAddRmsNorm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxGinCudaCollective);
