// The checkpoint store: layout and round trip, complete and torn directories, `latest`
// and its fallback, rotation, every damaged file named, fit checks, the async writer.
// The kill -9 in the middle of a save is checkpoint_kill_test.sh (real processes).
#include "pipeline/checkpoint/checkpoint.h"

#include <doctest/doctest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "pipeline/checkpoint/checkpoint_writer.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "tests/log_capture.h"
#include "tests/temp_dir.h"

using namespace gpipe;
using namespace gpipe::pipeline;
using gpipe::testing::LogCapture;
using gpipe::testing::TempDir;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Two stages' worth of state whose values depend on `step`.
std::vector<ShardTensors> make_shards(int64_t step) {
  const float s = static_cast<float>(step);
  std::vector<ShardTensors> shards(2);
  shards[0].model["layers.0.weight"] = Tensor::from_vector<float>({s, 2, 3, 4, 5, 6}, {2, 3});
  shards[0].model["layers.0.bias"] = Tensor::from_vector<double>({0.5, -s}, {2});
  shards[0].optimizer["layers.0.weight.exp_avg"] = Tensor::from_vector<float>({1, 1, 1, 1, 1, s}, {2, 3});
  shards[0].optimizer["layers.0.weight.step"] = step_tensor(step);
  shards[1].model["layers.1.weight"] = Tensor::from_vector<float>({7, s}, {1, 2});
  shards[1].model["layers.1.table"] = Tensor::from_vector<int32_t>({1, 2, 3}, {3});
  shards[1].optimizer["layers.1.weight.exp_avg"] = Tensor::from_vector<float>({0.25f, s}, {1, 2});
  shards[1].optimizer["layers.1.weight.step"] = step_tensor(step);
  return shards;
}

json state_of(int64_t step) { return {{"data_position", step * 64}, {"rng", {{"seed", 7}}}, {"config", "a: 1\n"}}; }

void expect_same(const TensorMap& a, const TensorMap& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    REQUIRE_MESSAGE(b.count(name), name);
    const Tensor& u = b.at(name);
    CHECK_MESSAGE((u.dtype() == t.dtype() && u.shape() == t.shape()), name);
    CHECK_MESSAGE(std::memcmp(u.raw_data(), t.raw_data(), t.nbytes()) == 0, name);
  }
}

TensorMap merged(const std::vector<ShardTensors>& shards, bool optimizer) {
  TensorMap out;
  for (const auto& s : shards) {
    for (const auto& kv : optimizer ? s.optimizer : s.model) out.insert(kv);
  }
  return out;
}

std::string load_error(const std::string& path) {
  try {
    load_checkpoint(path);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("checkpoint: the layout, Hugging Face's index, and a bit-exact round trip") {
  TempDir dir;
  CheckpointStore store(dir / "ckpt");
  const auto shards = make_shards(10);
  store.save(10, shards, state_of(10));

  const std::string sd = dir / "ckpt/step-10";
  for (const char* f : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                        "optimizer-00001-of-00002.safetensors", "optimizer-00002-of-00002.safetensors",
                        "model.safetensors.index.json", "optimizer.safetensors.index.json", "trainer_state.json",
                        "COMPLETE"}) {
    CHECK_MESSAGE(fs::is_regular_file(sd + "/" + f), f);
  }
  CHECK(std::distance(fs::directory_iterator(sd), fs::directory_iterator()) == 8);
  CHECK(read_file(dir / "ckpt/latest") == "step-10\n");
  const json index = json::parse(read_file(sd + "/model.safetensors.index.json"));
  CHECK(index["weight_map"]["layers.0.bias"] == "model-00001-of-00002.safetensors");
  CHECK(index["weight_map"]["layers.1.table"] == "model-00002-of-00002.safetensors");
  CHECK(index["metadata"]["total_size"] == 6 * 4 + 2 * 8 + 2 * 4 + 3 * 4);
  const json state = json::parse(read_file(sd + "/trainer_state.json"));
  CHECK(state["format_version"] == kCheckpointFormatVersion);
  CHECK(state["step"] == 10);
  CHECK(state["data_position"] == 640);

  const LoadedCheckpoint c = load_checkpoint(sd);
  CHECK(c.step == 10);
  CHECK(c.trainer_state["config"] == "a: 1\n");
  expect_same(merged(shards, false), c.model);
  expect_same(merged(shards, true), c.optimizer);
  CHECK(step_value(c.optimizer.at("layers.1.weight.step"), "layers.1.weight.step") == 10);

  // The checkpoints folder loads its newest complete checkpoint; a filter reads a subset.
  CHECK(load_checkpoint(dir / "ckpt").step == 10);
  LoadFilter only_stage1;
  only_stage1.model = [](const std::string& n) { return n.rfind("layers.1.", 0) == 0; };
  only_stage1.optimizer = only_stage1.model;
  const LoadedCheckpoint part = load_checkpoint(sd, only_stage1);
  CHECK(part.model.size() == 2);
  CHECK(part.optimizer.size() == 2);
}

TEST_CASE("checkpoint: a torn save is skipped with a warning naming it; latest falls back to scanning") {
  TempDir dir;
  CheckpointStore store(dir / "ckpt");
  store.save(10, make_shards(10), state_of(10));
  // Step 20 dies after its first shard: no index, no COMPLETE.
  const auto s20 = make_shards(20);
  store.write_shard(20, 0, 2, s20[0].model, s20[0].optimizer);
  {
    LogCapture log;
    const auto ref = find_latest_complete(dir / "ckpt");
    REQUIRE(ref);
    CHECK(ref->step == 10);
    CHECK(log.text().find(dir / "ckpt/step-20 is incomplete") != std::string::npos);
  }
  CHECK(load_error(dir / "ckpt/step-20").find("no COMPLETE marker") != std::string::npos);

  SUBCASE("latest names a missing directory") {
    write_file_atomically(dir / "ckpt/latest", std::string("step-99\n"));
    LogCapture log;
    CHECK(find_latest_complete(dir / "ckpt")->step == 10);
    CHECK(log.text().find("names 'step-99', which is missing or incomplete; using the newest complete") !=
          std::string::npos);
  }
  SUBCASE("latest names the torn directory") {
    write_file_atomically(dir / "ckpt/latest", std::string("step-20\n"));
    LogCapture log;
    CHECK(find_latest_complete(dir / "ckpt")->step == 10);
    CHECK(log.text().find("names 'step-20', which is missing or incomplete") != std::string::npos);
  }
  SUBCASE("latest holds garbage or is gone") {
    write_file_atomically(dir / "ckpt/latest", std::string("../../etc"));
    CHECK(find_latest_complete(dir / "ckpt")->step == 10);
    fs::remove(dir / "ckpt/latest");
    CHECK(find_latest_complete(dir / "ckpt")->step == 10);
  }
  SUBCASE("finishing the torn save makes it the latest") {
    store.write_shard(20, 1, 2, s20[1].model, s20[1].optimizer);
    store.finalize(20, 2, {names_of(s20[0]), names_of(s20[1])}, state_of(20));
    CHECK(find_latest_complete(dir / "ckpt")->step == 20);
    expect_same(merged(s20, false), load_checkpoint(dir / "ckpt").model);
  }
  CHECK_FALSE(find_latest_complete(dir / "nothing-here"));
}

TEST_CASE("checkpoint: keep rotates old checkpoints out only after the new one is complete") {
  TempDir dir;
  CheckpointStore store(dir / "ckpt", /*keep=*/2);
  for (int64_t step : {1, 2, 3}) store.save(step, make_shards(step), state_of(step));
  // A torn save of step 4 (killed), then step 5 completes: the torn one is older, so it goes.
  const auto s4 = make_shards(4);
  store.write_shard(4, 1, 2, s4[1].model, s4[1].optimizer);
  CHECK(fs::exists(dir / "ckpt/step-2"));
  store.save(5, make_shards(5), state_of(5));
  const CheckpointListing l = list_checkpoints(dir / "ckpt");
  REQUIRE(l.complete.size() == 2);
  CHECK(l.complete[0].step == 3);
  CHECK(l.complete[1].step == 5);
  CHECK(l.incomplete.empty());
  CHECK_FALSE(fs::exists(dir / "ckpt/step-1"));

  // A run resumed from step 3 saves step 4 again: step 5 (the abandoned future) stays,
  // `latest` names the new save, and only checkpoints at or below it rotate.
  store.save(4, make_shards(4), state_of(4));
  CHECK(find_latest_complete(dir / "ckpt")->step == 4);
  CHECK(fs::exists(dir / "ckpt/step-5/COMPLETE"));
  CHECK(fs::exists(dir / "ckpt/step-3/COMPLETE"));
}

TEST_CASE("checkpoint: keep neither deletes nor counts another run's step directories") {
  TempDir dir;
  CheckpointStore other(dir / "ckpt", 0, "run-b");
  other.save(1, make_shards(1), state_of(1));
  other.write_shard(2, 0, 2, make_shards(2)[0].model, make_shards(2)[0].optimizer);  // its torn save
  fs::create_directories(dir / "ckpt/step-0");  // torn, naming no run yet: a copy in progress, perhaps
  CheckpointStore store(dir / "ckpt", /*keep=*/1, "run-a");
  for (int64_t step : {3, 4, 5}) store.save(step, make_shards(step), state_of(step));
  CHECK(checkpoint_run_id(dir / "ckpt/step-1") == "run-b");
  CHECK(checkpoint_run_id(dir / "ckpt/step-5") == "run-a");
  CHECK(fs::exists(dir / "ckpt/step-1/COMPLETE"));
  CHECK(fs::exists(dir / "ckpt/step-2/model-00001-of-00002.safetensors"));
  CHECK_FALSE(fs::exists(dir / "ckpt/step-3"));
  CHECK_FALSE(fs::exists(dir / "ckpt/step-4"));
  CHECK(fs::exists(dir / "ckpt/step-5/COMPLETE"));
  CHECK(fs::exists(dir / "ckpt/step-0"));
  CHECK(checkpoint_run_id(dir / "nothing-here") == "");
}

TEST_CASE("checkpoint: keep leaves a step whose COMPLETE marker came before its trainer state (a copy in progress)") {
  TempDir dir;
  CheckpointStore store(dir / "ckpt", /*keep=*/1, "run-a");
  store.save(3, make_shards(3), state_of(3));
  // cp copies in directory order: the marker and a shard, but no trainer_state.json yet.
  fs::create_directories(dir / "ckpt/step-2");
  fs::copy_file(dir / "ckpt/step-3/COMPLETE", dir / "ckpt/step-2/COMPLETE");
  // And one whose trainer_state.json is half written.
  fs::create_directories(dir / "ckpt/step-1");
  fs::copy_file(dir / "ckpt/step-3/COMPLETE", dir / "ckpt/step-1/COMPLETE");
  std::ofstream(dir / "ckpt/step-1/trainer_state.json") << "{\"step\": 1, \"run_";
  store.save(4, make_shards(4), state_of(4));
  CHECK(fs::exists(dir / "ckpt/step-2/COMPLETE"));
  CHECK(fs::exists(dir / "ckpt/step-1/trainer_state.json"));
  CHECK_FALSE(fs::exists(dir / "ckpt/step-3"));
  CHECK(fs::exists(dir / "ckpt/step-4/COMPLETE"));
}

TEST_CASE("checkpoint: a saved step saved again is incomplete until finalized, and leftovers are removed") {
  TempDir dir;
  CheckpointStore store(dir / "ckpt");
  store.save(7, make_shards(7), state_of(7));
  // A stray temporary and a shard of another count, as a torn earlier save leaves them.
  write_file_atomically(dir / "ckpt/step-7/.model-00001-of-00002.safetensors.1.0.tmp", std::string("x"));
  write_file_atomically(dir / "ckpt/step-7/model-00001-of-00003.safetensors", std::string("x"));
  const auto s = make_shards(7);
  store.write_shard(7, 0, 2, s[0].model, s[0].optimizer);
  CHECK_FALSE(fs::exists(dir / "ckpt/step-7/COMPLETE"));
  store.write_shard(7, 1, 2, s[1].model, s[1].optimizer);
  store.finalize(7, 2, {names_of(s[0]), names_of(s[1])}, state_of(7));
  CHECK(fs::exists(dir / "ckpt/step-7/COMPLETE"));
  CHECK(std::distance(fs::directory_iterator(dir / "ckpt/step-7"), fs::directory_iterator()) == 8);
}

TEST_CASE("checkpoint: finalize refuses a missing shard, a missing tensor and a tensor saved twice") {
  TempDir dir;
  CheckpointStore store(dir / "ckpt");
  const auto s = make_shards(3);
  store.write_shard(3, 0, 2, s[0].model, s[0].optimizer);
  const std::vector<ShardNames> names = {names_of(s[0]), names_of(s[1])};
  CHECK_THROWS_WITH(store.finalize(3, 2, names, state_of(3)),
                    doctest::Contains("model-00002-of-00002.safetensors': cannot open"));
  store.write_shard(3, 1, 2, s[1].model, s[1].optimizer);
  auto more = names;
  more[1].model.push_back("layers.1.ghost");
  CHECK_THROWS_WITH(store.finalize(3, 2, more, state_of(3)), doctest::Contains("lacks tensor(s)"));
  CHECK_THROWS_WITH(store.finalize(3, 2, more, state_of(3)), doctest::Contains("layers.1.ghost"));
  store.write_shard(3, 1, 2, s[0].model, {});  // stage 1 writes stage 0's tensors too
  CHECK_THROWS_WITH(store.finalize(3, 2, {names_of(s[0]), {names[0].model, {}}}, state_of(3)),
                    doctest::Contains("is in two checkpoint shards"));
  CHECK_FALSE(fs::exists(dir / "ckpt/step-3/COMPLETE"));
}

TEST_CASE("checkpoint: a damaged checkpoint is refused, naming the file and the problem") {
  TempDir dir;
  CheckpointStore store(dir / "ckpt");
  store.save(5, make_shards(5), state_of(5));
  const std::string sd = dir / "ckpt/step-5";
  const std::string shard2 = sd + "/model-00002-of-00002.safetensors";

  SUBCASE("truncated shard") {
    fs::resize_file(shard2, fs::file_size(shard2) - 3);
    const std::string msg = load_error(sd);
    CHECK(msg.find(shard2) != std::string::npos);
    CHECK(msg.find("truncated") != std::string::npos);
  }
  SUBCASE("a shard missing a tensor its index lists") {
    TensorMap fewer = make_shards(5)[1].model;
    fewer.erase("layers.1.table");
    save_safetensors(shard2, fewer);
    const std::string msg = load_error(sd);
    CHECK(msg.find(shard2 + "' lacks tensor(s) that model.safetensors.index.json lists: layers.1.table") !=
          std::string::npos);
  }
  SUBCASE("a missing shard") {
    fs::remove(shard2);
    CHECK(load_error(sd).find(shard2 + "': cannot open") != std::string::npos);
  }
  SUBCASE("an index reaching outside the directory") {
    write_file_atomically(sd + "/optimizer.safetensors.index.json",
                          std::string(R"({"metadata": {"total_size": 0}, "weight_map": {"x": "../evil"}})"));
    CHECK(load_error(sd).find("not a file name in the checkpoint directory") != std::string::npos);
  }
  SUBCASE("a corrupt trainer state") {
    write_file_atomically(sd + "/trainer_state.json", std::string("{\"step\": 5,"));
    CHECK(load_error(sd).find("trainer_state.json' is not valid JSON") != std::string::npos);
  }
  SUBCASE("an unknown format version") {
    json st = json::parse(read_file(sd + "/trainer_state.json"));
    st["format_version"] = 99;
    write_file_atomically(sd + "/trainer_state.json", st.dump());
    CHECK(load_error(sd).find("has format version 99; this gpipe reads versions 1 and 2") != std::string::npos);
  }
  SUBCASE("a wrong total size") {
    json idx = json::parse(read_file(sd + "/model.safetensors.index.json"));
    idx["metadata"]["total_size"] = 1;
    write_file_atomically(sd + "/model.safetensors.index.json", idx.dump());
    CHECK(load_error(sd).find("total_size is 1 but the shards hold") != std::string::npos);
  }
  SUBCASE("not a directory") { CHECK(load_error(dir / "nope").find("does not exist") != std::string::npos); }
}

// The bytes of a shard's tensor data, flipped in place (the header and its metadata untouched).
void flip_data_byte(const std::string& path, uint64_t from_end) {
  std::string bytes = read_file(path);
  bytes[bytes.size() - from_end] ^= 0x01;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST_CASE("checkpoint: every tensor's checksum and every shard's step and run are checked on load") {
  TempDir dir;
  CheckpointStore store(dir / "ckpt", 0, "run-a");
  store.save(5, make_shards(5), state_of(5));
  store.save(6, make_shards(6), state_of(6));
  const std::string sd = dir / "ckpt/step-6";
  const std::string shard1 = sd + "/model-00001-of-00002.safetensors";
  const auto header = read_safetensors_header(shard1);
  CHECK(header.metadata.at("run_id") == "run-a");
  CHECK(header.metadata.at("step") == "6");
  // The checksums are XXH3-64 of each tensor's bytes, independently of how the store computes them.
  const json sums = json::parse(header.metadata.at("checksums"));
  CHECK(sums.size() == 2);
  CHECK(sums.at("layers.0.weight") == tensor_checksum(make_shards(6)[0].model.at("layers.0.weight")));
  // XXH3-64 of the bytes 00 00 80 3f (1.0f), as `xxhsum -H3` (xxHash 0.8.1) prints it.
  CHECK(tensor_checksum(Tensor::from_vector<float>({1}, {1})) == "f87b05471331b3ae");
  CHECK(json::parse(read_file(sd + "/trainer_state.json"))["run_id"] == "run-a");
  expect_same(load_checkpoint(sd).model, merged(make_shards(6), false));

  SUBCASE("one flipped bit in a tensor's data") {
    flip_data_byte(shard1, 3);
    const std::string msg = load_error(sd);
    CHECK(msg.find(shard1 + "': tensor '") != std::string::npos);
    CHECK(msg.find("does not match its checksum") != std::string::npos);
    CHECK_THROWS_AS(load_checkpoint(sd), CheckpointDamaged);
  }
  SUBCASE("a flipped bit in a tensor that is not read is not this reader's to find") {
    flip_data_byte(shard1, 3);  // in layers.0.weight (F32), laid out after layers.0.bias (F64)
    LoadFilter only_bias;
    only_bias.model = [](const std::string& n) { return n == "layers.0.bias"; };
    CHECK(load_checkpoint(sd, only_bias).model.size() == 1);
  }
  SUBCASE("a shard copied in from another step") {
    fs::copy_file(dir / "ckpt/step-5/model-00001-of-00002.safetensors", shard1, fs::copy_options::overwrite_existing);
    CHECK(load_error(sd).find(shard1 + "' says it holds step 5 but its checkpoint is of step 6") != std::string::npos);
  }
  SUBCASE("a shard copied in from another run") {
    TempDir other;
    CheckpointStore(other / "ckpt", 0, "run-b").save(6, make_shards(6), state_of(6));
    fs::copy_file(other / "ckpt/step-6/optimizer-00002-of-00002.safetensors", sd + "/optimizer-00002-of-00002.safetensors",
                  fs::copy_options::overwrite_existing);
    CHECK(load_error(sd).find("belongs to run run-b but its checkpoint is of run run-a") != std::string::npos);
  }
  SUBCASE("checksums stripped from a shard's metadata") {
    const auto f = load_safetensors(shard1);
    StringMap meta = f.metadata;
    meta.erase("checksums");
    save_safetensors(shard1, f.tensors, meta);
    CHECK(load_error(sd).find("has no readable \"checksums\"") != std::string::npos);
  }
  SUBCASE("a save never writes into another run's step, and finalize refuses a shard another run wrote") {
    CheckpointStore(dir / "ckpt", 0, "run-b").write_shard(7, 0, 2, make_shards(7)[0].model, {});
    CheckpointStore b(dir / "ckpt", 0, "run-a");
    CHECK(checkpoint_run_id(dir / "ckpt/step-7") == "run-b");  // a torn save: its shard says its run
    CHECK_THROWS_WITH_AS(b.write_shard(7, 1, 2, make_shards(7)[1].model, {}),
                         doctest::Contains("ckpt/step-7 holds a checkpoint of another run (run-b), not of this run "
                                           "run-a, and gpipe never overwrites another run's checkpoint"),
                         UserError);
    CHECK(fs::exists(dir / "ckpt/step-7/model-00001-of-00002.safetensors"));
    // A shard of another run copied in after this run's first shard: refused by finalize.
    fs::remove_all(dir / "ckpt/step-7");
    b.write_shard(7, 1, 2, make_shards(7)[1].model, {});
    CheckpointStore(dir / "other", 0, "run-b").write_shard(7, 0, 2, make_shards(7)[0].model, {});
    fs::copy_file(dir / "other/step-7/model-00001-of-00002.safetensors", dir / "ckpt/step-7/model-00001-of-00002.safetensors");
    CHECK_THROWS_WITH_AS(b.finalize(7, 2, {{{"layers.0.weight", "layers.0.bias"}, {}}, {{"layers.1.weight", "layers.1.table"}, {}}}, {}),
                         doctest::Contains("was written by run run-b, not by this run run-a"), Error);
  }
}

TEST_CASE("checkpoint: check_tensors_fit lists missing, extra and mismatched tensors with both shapes") {
  const TensorMap loaded = make_shards(1)[0].model;  // layers.0.weight f32 (2, 3), layers.0.bias f64 (2)
  std::map<std::string, TensorSpec> expected = {{"layers.0.weight", {{2, 3}, DType::kF32}},
                                                {"layers.0.bias", {{2}, DType::kF64}}};
  check_tensors_fit(loaded, expected, "model", "ck");
  expected["layers.0.weight"].shape = {3, 2};
  expected.erase("layers.0.bias");
  expected["layers.9.weight"] = {{4}, DType::kF32};
  try {
    check_tensors_fit(loaded, expected, "model", "ck/step-1");
    FAIL("no error");
  } catch (const UserError& e) {
    const std::string msg = e.what();
    CHECK(msg.find("missing from the checkpoint: layers.9.weight") != std::string::npos);
    CHECK(msg.find("in the checkpoint but not in the model: layers.0.bias") != std::string::npos);
    CHECK(msg.find("layers.0.weight is float32(2, 3) in the checkpoint but float32(3, 2) in the model") !=
          std::string::npos);
  }
}

TEST_CASE("checkpoint: the async writer saves in the background, one save at a time, and rethrows errors") {
  TempDir dir;
  ::setenv(kCheckpointPauseEnv, "20", 1);  // each save takes a while
  {
    AsyncCheckpointWriter w(CheckpointStore(dir / "ckpt"));
    auto live = make_shards(1);
    std::vector<ShardTensors> copies;
    for (const auto& s : live) copies.push_back({host_copy(s.model), host_copy(s.optimizer)});
    w.save(1, copies, state_of(1));
    live[0].model["layers.0.weight"].data<float>()[0] = -1;  // training goes on: the save holds copies
    w.save(2, make_shards(2), state_of(2));
    // Starting save 2 waited for save 1.
    CHECK(fs::exists(dir / "ckpt/step-1/COMPLETE"));
    w.wait();
    CHECK(w.idle());
    CHECK(load_checkpoint(dir / "ckpt/step-1").model.at("layers.0.weight").data<float>()[0] == 1.0f);
    CHECK(find_latest_complete(dir / "ckpt")->step == 2);
  }
  ::unsetenv(kCheckpointPauseEnv);
  // A save that cannot be written: the error comes back from wait(), once.
  write_file_atomically(dir / "file", std::string("not a folder"));
  AsyncCheckpointWriter bad(CheckpointStore(dir / "file/ckpt"));
  bad.save(1, make_shards(1), state_of(1));
  CHECK_THROWS_WITH_AS(bad.wait(), doctest::Contains("cannot create the checkpoint folder"), UserError);
  bad.wait();
}

TEST_CASE("checkpoint: names and step counts") {
  CHECK(shard_file_name("model", 0, 2) == "model-00001-of-00002.safetensors");
  CHECK(shard_file_name("optimizer", 11, 12) == "optimizer-00012-of-00012.safetensors");
  CHECK_THROWS(shard_file_name("model", 2, 2));
  CHECK(step_dir_name(42) == "step-42");
  CHECK(step_value(step_tensor(123456789), "s") == 123456789);
  CHECK_THROWS_AS(step_value(Tensor::from_vector<float>({1}, {}), "s"), UserError);
  CHECK_THROWS_AS(step_value(Tensor::from_vector<double>({1.5}, {}), "s"), UserError);
}
