// ddp_bench's models (bench_models.h): the MLP stack and the GPT-style decoder, and their data.
#include "bench/bench_models.h"

#include "tp/linear_with_grad_in_buffer.h"

#include <sstream>

namespace bench {

namespace {

// at::linear, not fc.forward(x): the C++ frontend's Linear computes a 3-D input as matmul, then
// += bias (two bf16 roundings), while at::linear (Python's nn.Linear, and linear_with_grad_in_buffer)
// runs one addmm on the flattened input; with fc.forward, local's bf16 GPT loss differed from
// meshddp's at the first step (4.6656647 vs 4.6657729).
at::Tensor apply_linear(const at::Tensor& x, torch::nn::LinearImpl& fc, bool grads_in_buffer) {
  return grads_in_buffer ? meshddp::linear_with_grad_in_buffer(x, fc.weight, fc.bias)
                         : at::linear(x, fc.weight, fc.bias);
}

}  // namespace

at::Tensor BenchModel::linear(const at::Tensor& x, torch::nn::LinearImpl& fc) const {
  return apply_linear(x, fc, grads_in_buffer);
}

namespace {

// A deep MLP stack (Linear + ReLU), hidden x hidden layers, MSE loss.
class MlpStack : public BenchModel {
 public:
  MlpStack(int64_t hidden, int64_t layers) {
    for (int64_t l = 0; l < layers; ++l) blocks_->push_back(torch::nn::Linear(hidden, hidden));
    register_module("blocks", blocks_);
  }
  at::Tensor forward(const at::Tensor& input) override {
    at::Tensor x = input;
    for (size_t l = 0; l < blocks_->size(); ++l) {
      x = linear(x, *blocks_->ptr<torch::nn::LinearImpl>(l));
      if (l + 1 < blocks_->size()) x = torch::relu(x);
    }
    return x;
  }
  at::Tensor loss(const at::Tensor& output, const at::Tensor& target) const override {
    return torch::mse_loss(output, target);
  }

 private:
  torch::nn::ModuleList blocks_;
};

// A pre-LayerNorm transformer block: x + proj(causal_attention(qkv(ln1(x)))), then
// x + fc2(gelu(fc1(ln2(x)))). One fused QKV Linear; attention is at::scaled_dot_product_attention
// (causal, no dropout), so CUDA picks its flash or memory-efficient kernel.
class Block : public torch::nn::Module {
 public:
  Block(int64_t hidden, int64_t heads)
      : heads_(heads),
        ln1_(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})))),
        qkv_(register_module("qkv", torch::nn::Linear(hidden, 3 * hidden))),
        proj_(register_module("proj", torch::nn::Linear(hidden, hidden))),
        ln2_(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})))),
        fc1_(register_module("fc1", torch::nn::Linear(hidden, 4 * hidden))),
        fc2_(register_module("fc2", torch::nn::Linear(4 * hidden, hidden))) {}

  at::Tensor forward(const at::Tensor& x, bool grads_in_buffer) {
    auto linear = [grads_in_buffer](const at::Tensor& in, torch::nn::Linear& fc) {
      return apply_linear(in, *fc, grads_in_buffer);
    };
    const int64_t b = x.size(0), s = x.size(1), h = x.size(2);
    // [b, s, 3h] -> [3, b, heads, s, head_dim]
    auto qkv = linear(ln1_->forward(x), qkv_).view({b, s, 3, heads_, h / heads_}).permute({2, 0, 3, 1, 4});
    auto y = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                              /*is_causal=*/true);
    auto out = x + linear(y.transpose(1, 2).reshape({b, s, h}), proj_);
    return out + linear(torch::gelu(linear(ln2_->forward(out), fc1_)), fc2_);
  }

 private:
  int64_t heads_;
  torch::nn::LayerNorm ln1_;
  torch::nn::Linear qkv_, proj_;
  torch::nn::LayerNorm ln2_;
  torch::nn::Linear fc1_, fc2_;
};

// Token + learned position embeddings, pre-LN blocks, a final LayerNorm and an untied LM head
// (Linear without bias). Loss: mean cross-entropy of the logits, in fp32, against target tokens.
class Gpt : public BenchModel {
 public:
  // Registered in forward order (embeddings, blocks, ln_f, head) like Megatron's GPT: the flat buffer's
  // reverse registration order is then backward's order, and the head's bucket launches first.
  explicit Gpt(const ModelOptions& o) {
    TORCH_CHECK(o.heads > 0 && o.hidden % o.heads == 0, "ddp_bench: --hidden ", o.hidden,
                " must be a multiple of --heads ", o.heads);
    tok_ = register_module("tok_emb", torch::nn::Embedding(o.vocab, o.hidden));
    pos_ = register_module("pos_emb", torch::nn::Embedding(o.seq, o.hidden));
    for (int64_t l = 0; l < o.layers; ++l) {
      blocks_.push_back(std::make_shared<Block>(o.hidden, o.heads));
      block_list_->push_back(blocks_.back());
    }
    register_module("blocks", block_list_);  // params "blocks.<l>.qkv.weight", ...
    ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.hidden})));
    head_ = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(o.hidden, o.vocab).bias(false)));
  }
  at::Tensor forward(const at::Tensor& tokens) override {
    TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) <= pos_->weight.size(0),
                "ddp_bench: GPT input must be [batch, seq<=", pos_->weight.size(0), "], got ", tokens.sizes());
    auto positions = at::arange(tokens.size(1), tokens.options());
    at::Tensor x = tok_->forward(tokens) + pos_->forward(positions);
    for (auto& block : blocks_) x = block->forward(x, grads_in_buffer);
    return linear(ln_f_->forward(x), *head_);
  }
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& target) const override {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                                target.reshape({-1}));
  }

 private:
  torch::nn::Embedding tok_{nullptr}, pos_{nullptr};
  std::vector<std::shared_ptr<Block>> blocks_;  // typed access to block_list_'s entries
  torch::nn::ModuleList block_list_;
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
};

}  // namespace

std::shared_ptr<BenchModel> make_bench_model(const ModelOptions& o) {
  torch::manual_seed(o.seed);  // every candidate starts from the same weights
  std::shared_ptr<BenchModel> model;
  if (o.kind == "mlp") {
    model = std::make_shared<MlpStack>(o.hidden, o.layers);
  } else {
    TORCH_CHECK(o.kind == "gpt", "ddp_bench: --model must be mlp or gpt, got '", o.kind, "'");
    model = std::make_shared<Gpt>(o);
  }
  model->to(o.device, o.dtype);
  return model;
}

Batch make_batch(const ModelOptions& o, int64_t rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 7919 + 17 + rank);
  Batch batch;
  if (o.kind == "gpt") {
    batch.input = torch::randint(o.vocab, {o.batch, o.seq}, gen, torch::kLong);
    batch.target = torch::randint(o.vocab, {o.batch, o.seq}, gen, torch::kLong);
  } else {
    batch.input = torch::randn({o.batch, o.hidden}, gen).to(o.dtype);
    batch.target = torch::randn({o.batch, o.hidden}, gen).to(o.dtype);
  }
  batch.input = batch.input.to(o.device);
  batch.target = batch.target.to(o.device);
  return batch;
}

std::string describe(const ModelOptions& o) {
  std::ostringstream out;
  if (o.kind == "gpt") {
    out << "GPT " << o.layers << " blocks, hidden " << o.hidden << ", " << o.heads << " heads, seq " << o.seq
        << ", vocab " << o.vocab;
  } else {
    out << "MLP stack " << o.layers << " x Linear(" << o.hidden << ", " << o.hidden << ")";
  }
  out << ", " << (o.dtype == at::kBFloat16 ? "bf16" : "fp32");
  return out.str();
}

}  // namespace bench
