// The per-rank Newton-Schulz load of whole-param ownership (grad_buffer/whole_param_layout.h) for the
// bench GPT preset (gpt1b: 18 blocks, hidden 2048, vocab 32000, seq 1024, bf16; bench_models.cpp's
// shapes): max/mean over the DP ranks of the summed max(m,n) min(m,n)^2 of the Muon matrices each
// owns, for the LPT bin packing against a naive round-robin over the same buckets, and the padding
// the whole-param layout adds. Pure layout arithmetic: no tensors, no process group.
//   whole_param_balance_bench [--layers 18] [--hidden 2048] [--vocab 32000] [--seq 1024] [--bucket-mib 40]
#include "grad_buffer/whole_param_layout.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

using namespace meshddp;

namespace {

struct Shape {
  std::string name;
  std::vector<int64_t> sizes;
};

std::vector<Shape> gpt_shapes(int64_t layers, int64_t hidden, int64_t vocab, int64_t seq) {
  std::vector<Shape> out{{"tok_emb.weight", {vocab, hidden}}, {"pos_emb.weight", {seq, hidden}}};
  for (int64_t l = 0; l < layers; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    for (const Shape& s : std::vector<Shape>{{"ln1.weight", {hidden}},
                                             {"ln1.bias", {hidden}},
                                             {"qkv.weight", {3 * hidden, hidden}},
                                             {"qkv.bias", {3 * hidden}},
                                             {"proj.weight", {hidden, hidden}},
                                             {"proj.bias", {hidden}},
                                             {"ln2.weight", {hidden}},
                                             {"ln2.bias", {hidden}},
                                             {"fc1.weight", {4 * hidden, hidden}},
                                             {"fc1.bias", {4 * hidden}},
                                             {"fc2.weight", {hidden, 4 * hidden}},
                                             {"fc2.bias", {hidden}}})
      out.push_back({b + s.name, s.sizes});
  }
  out.push_back({"ln_f.weight", {hidden}});
  out.push_back({"ln_f.bias", {hidden}});
  out.push_back({"head.weight", {vocab, hidden}});
  return out;
}

bool is_muon_matrix(const Shape& s) {
  return s.sizes.size() == 2 && s.name.find("emb") == std::string::npos && s.name.find("head") == std::string::npos;
}

double max_over_mean(const std::vector<double>& v) {
  const double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return *std::max_element(v.begin(), v.end()) / mean;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t layers = 18, hidden = 2048, vocab = 32000, seq = 1024, bucket_mib = 40;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int64_t v = std::atoll(argv[i + 1]);
    if (flag == "--layers")
      layers = v;
    else if (flag == "--hidden")
      hidden = v;
    else if (flag == "--vocab")
      vocab = v;
    else if (flag == "--seq")
      seq = v;
    else if (flag == "--bucket-mib")
      bucket_mib = v;
    else {
      std::fprintf(stderr, "whole_param_balance_bench: unknown flag '%s'\n", flag.c_str());
      return 2;
    }
  }
  const std::vector<Shape> shapes = gpt_shapes(layers, hidden, vocab, seq);
  std::vector<ParamSpec> params;
  for (const Shape& s : shapes) {
    int64_t numel = 1;
    for (int64_t x : s.sizes) numel *= x;
    ParamSpec p{s.name, numel, c10::kBFloat16, c10::kBFloat16, c10::Device(c10::kCPU)};
    p.shape = s.sizes;
    params.push_back(p);
  }
  // Muon's cost for its matrices, the element count (AdamW's) for the rest.
  const ParamCostFn cost = [&](const ParamSpec& p) {
    for (const Shape& s : shapes) {
      if (s.name == p.name) return is_muon_matrix(s) ? newton_schulz_cost(p.shape) : static_cast<double>(p.numel);
    }
    return static_cast<double>(p.numel);
  };
  std::printf("GPT %ld blocks, hidden %ld, vocab %ld, seq %ld, bf16, buckets of %ld MiB\n", (long)layers, (long)hidden,
              (long)vocab, (long)seq, (long)bucket_mib);
  std::printf("%4s %8s %14s %14s %12s\n", "dp", "buckets", "LPT max/mean", "RR max/mean", "padding");
  for (int64_t dp : {2, 4, 8}) {
    const LayoutConfig config{static_cast<size_t>(bucket_mib) << 20, true, dp};
    BucketLayout layout = assign_buckets(params, config);
    std::vector<int64_t> owners;
    place_whole_params(layout, params, config, cost, &owners);
    std::vector<double> lpt(dp, 0.0), rr(dp, 0.0);
    int64_t next = 0, total = 0;
    for (const BucketSpan& span : layout.buckets) {  // round-robin: the matrices in bucket order
      for (int64_t p : span.params) {
        total += params[p].numel;
        if (!is_muon_matrix(shapes[p])) continue;
        lpt[owners[p]] += newton_schulz_cost(params[p].shape);
        rr[next++ % dp] += newton_schulz_cost(params[p].shape);
      }
    }
    const int64_t buffer = layout.buffers.front().numel;
    std::printf("%4ld %8zu %14.3f %14.3f %11.2f%%\n", (long)dp, layout.buckets.size(), max_over_mean(lpt),
                max_over_mean(rr), 100.0 * static_cast<double>(buffer - total) / static_cast<double>(total));
  }
  return 0;
}
