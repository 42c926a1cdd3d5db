#include "tensor_buffers.h"

#include <fmt/format.h>

namespace torch_ddp {
namespace {

bool native_dtype(at::ScalarType type, ddp::DType& out) {
  switch (type) {
    case at::kFloat:
      out = ddp::DType::kFloat32;
      return true;
    case at::kDouble:
      out = ddp::DType::kFloat64;
      return true;
    case at::kHalf:
      out = ddp::DType::kFloat16;
      return true;
    case at::kBFloat16:
      out = ddp::DType::kBFloat16;
      return true;
    case at::kChar:
      out = ddp::DType::kInt8;
      return true;
    case at::kByte:
      out = ddp::DType::kUInt8;
      return true;
    case at::kInt:
      out = ddp::DType::kInt32;
      return true;
    case at::kLong:
      out = ddp::DType::kInt64;
      return true;
    default:
      return false;
  }
}

std::string op_name(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return fmt::format("op {}", static_cast<int>(op));
  }
}

}  // namespace

std::string dtype_name(at::ScalarType type) {
  return "torch." + std::string(c10::getDtypeNames(type).first);
}

Buffer movement_buffer(const at::Tensor& contiguous) {
  Buffer buffer{contiguous.data_ptr(), static_cast<std::size_t>(contiguous.numel()),
                ddp::DType::kUInt8};
  if (!native_dtype(contiguous.scalar_type(), buffer.dtype)) {
    buffer.dtype = ddp::DType::kUInt8;
    buffer.count = contiguous.numel() * contiguous.element_size();
  }
  return buffer;
}

Reduction reduction_buffer(const at::Tensor& contiguous, const c10d::ReduceOp& op,
                           const std::string& call) {
  const auto type = contiguous.scalar_type();
  const auto kind = op.op_;
  Reduction r;
  r.buffer = {contiguous.data_ptr(), static_cast<std::size_t>(contiguous.numel()),
              ddp::DType::kUInt8};
  auto refuse = [&](const std::string& why) {
    TORCH_CHECK(false, "ddp backend: ", call, " with ReduceOp.", op_name(kind), " on a ",
                dtype_name(type), " tensor: ", why);
  };
  if (type == at::kBool) {
    // A bool is a byte holding 0 or 1: MAX is logical or (c10d's SUM and BOR on bools), MIN is
    // logical and (PRODUCT and BAND), and neither can leave 0/1.
    r.buffer.dtype = ddp::DType::kUInt8;
    switch (kind) {
      case c10d::ReduceOp::SUM:
      case c10d::ReduceOp::BOR:
      case c10d::ReduceOp::MAX:
        r.op = ddp::ReduceOp::kMax;
        return r;
      case c10d::ReduceOp::PRODUCT:
      case c10d::ReduceOp::BAND:
      case c10d::ReduceOp::MIN:
        r.op = ddp::ReduceOp::kMin;
        return r;
      case c10d::ReduceOp::BXOR:
        r.op = ddp::ReduceOp::kBxor;  // 0/1 bytes stay 0/1
        return r;
      default:
        refuse("bool tensors reduce with SUM, PRODUCT, MIN, MAX, BAND, BOR and BXOR");
    }
  }
  if (type == at::kComplexFloat || type == at::kComplexDouble) {
    if (kind != c10d::ReduceOp::SUM && kind != c10d::ReduceOp::AVG) {
      refuse(
          "complex tensors reduce with SUM and AVG only (element-wise over the real and "
          "imaginary parts, as c10d allows)");
    }
    r.buffer.dtype = type == at::kComplexFloat ? ddp::DType::kFloat32 : ddp::DType::kFloat64;
    r.buffer.count *= 2;
  } else if (!native_dtype(type, r.buffer.dtype)) {
    refuse(
        "ddp reduces float32, float64, float16, bfloat16, int8, uint8, int32, int64, bool and "
        "complex tensors; convert the tensor (e.g. .to(torch.int32)) or use gloo for it");
  }
  switch (kind) {
    case c10d::ReduceOp::SUM:
      r.op = ddp::ReduceOp::kSum;
      break;
    case c10d::ReduceOp::AVG:
      r.op = ddp::ReduceOp::kAvg;
      break;
    case c10d::ReduceOp::PRODUCT:
      r.op = ddp::ReduceOp::kProduct;
      break;
    case c10d::ReduceOp::MIN:
      r.op = ddp::ReduceOp::kMin;
      break;
    case c10d::ReduceOp::MAX:
      r.op = ddp::ReduceOp::kMax;
      break;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      if (!c10::isIntegralType(type, /*includeBool=*/false)) {
        refuse(
            "bitwise reductions take integer and bool tensors (as gloo); reduce floating-point "
            "tensors with SUM, AVG, MIN, MAX or PRODUCT");
      }
      r.op = kind == c10d::ReduceOp::BAND  ? ddp::ReduceOp::kBand
             : kind == c10d::ReduceOp::BOR ? ddp::ReduceOp::kBor
                                           : ddp::ReduceOp::kBxor;
      break;
    case c10d::ReduceOp::PREMUL_SUM:
      // The caller reduces premultiplied()'s scaled copy.
      if (!at::isFloatingType(type)) {
        refuse(
            "PREMUL_SUM takes floating-point tensors (as NCCL); multiply it yourself and use SUM");
      }
      r.op = ddp::ReduceOp::kSum;
      break;
    default:
      refuse("ddp does not know this reduce op");
  }
  return r;
}

at::Tensor premultiplied(const at::Tensor& input, const c10d::ReduceOp& op,
                         const std::string& call) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return input;
  TORCH_CHECK(at::isFloatingType(input.scalar_type()), "ddp backend: ", call,
              " with ReduceOp.PREMUL_SUM on a ", dtype_name(input.scalar_type()),
              " tensor: PREMUL_SUM takes floating-point tensors (as NCCL); multiply it yourself "
              "and use SUM");
  const auto* factor = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(factor != nullptr, "ddp backend: ", call,
              " with ReduceOp.PREMUL_SUM but no factor: make the op with "
              "torch.distributed._make_nccl_premul_sum(factor)");
  at::NoGradGuard no_grad;
  if (factor->tensor_factor.defined()) {
    TORCH_CHECK(factor->tensor_factor.numel() == 1, "ddp backend: ", call,
                "'s PREMUL_SUM factor has ", factor->tensor_factor.numel(),
                " elements; it takes one");
    return (input * factor->tensor_factor.to(at::kCPU, input.scalar_type()).reshape({}))
        .contiguous();
  }
  return (input * factor->double_factor).contiguous();
}

void check_cpu_dense(const at::Tensor& tensor, const std::string& what) {
  TORCH_CHECK(tensor.defined(), "ddp backend: ", what, " is an undefined tensor");
  TORCH_CHECK(tensor.layout() == at::kStrided, "ddp backend: ", what, " is a ", tensor.layout(),
              " tensor; ddp takes dense (strided) tensors: call .to_dense() first, or use gloo "
              "for sparse allreduce");
  TORCH_CHECK(tensor.device().is_cpu(), "ddp backend: ", what, " is on ", tensor.device(),
              "; the ddp backend takes CPU tensors (initialise with backend=\"cpu:ddp,cuda:nccl\" "
              "to send CUDA tensors through NCCL)");
}

void check_output_matches_input(const at::Tensor& output, const at::Tensor& input,
                                const std::string& call) {
  check_cpu_dense(input, call + "'s input");
  check_cpu_dense(output, call + "'s output");
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "ddp backend: ", call, "'s output is ",
              dtype_name(output.scalar_type()), " but its input is ",
              dtype_name(input.scalar_type()));
}

void check_count(const std::vector<at::Tensor>& tensors, std::size_t expected,
                 const std::string& what) {
  TORCH_CHECK(tensors.size() == expected, "ddp backend: ", what, " takes ", expected,
              " tensor(s) per rank, got ", tensors.size(),
              " (several tensors per call were for several devices; pass one)");
}

void check_same_type_and_size(const std::vector<at::Tensor>& tensors, const at::Tensor& like,
                              const std::string& what) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    check_cpu_dense(tensors[i], fmt::format("{} {}", what, i));
    TORCH_CHECK(tensors[i].scalar_type() == like.scalar_type(), "ddp backend: ", what, " ", i,
                " is ", dtype_name(tensors[i].scalar_type()), " but the input is ",
                dtype_name(like.scalar_type()));
    TORCH_CHECK(tensors[i].numel() == like.numel(), "ddp backend: ", what, " ", i, " has ",
                tensors[i].numel(), " elements but the input has ", like.numel());
  }
}

Contiguous contiguous_of(const at::Tensor& tensor) {
  // The engine reads and writes flat buffers. gloo refuses some non-contiguous tensors and not
  // others; a copy written back after success gives every call the same, correct answer.
  if (tensor.is_contiguous()) return {tensor, false};
  return {tensor.contiguous(), true};
}

}  // namespace torch_ddp
