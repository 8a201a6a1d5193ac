#include "compute_node/safetensors.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "safetensors_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // Writes `bytes` as they are.
  std::string WriteBytes(const std::string& name, const std::string& bytes) const {
    const std::string path = Path(name);
    std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path;
  }
  // Writes a file with header `json` (its true length unless `length` is given) and `data_size`
  // bytes of data.
  std::string WriteRaw(const std::string& name, const std::string& json, size_t data_size,
                       std::optional<uint64_t> length = std::nullopt) const {
    const uint64_t n = length.value_or(json.size());
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return WriteBytes(name, bytes + json + std::string(data_size, '\x5a'));
  }

  // Opens `path`, expecting `code` and each of `parts` in the message (and always the path).
  void ExpectError(const std::string& path, absl::StatusCode code,
                   const std::vector<std::string>& parts) const {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok()) << path;
    EXPECT_EQ(file.status().code(), code) << file.status();
    EXPECT_THAT(std::string(file.status().message()), HasSubstr(path));
    for (const std::string& part : parts) {
      EXPECT_THAT(std::string(file.status().message()), HasSubstr(part));
    }
  }

  std::string dir_;
};

std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + 31 * i);
  return v;
}

TEST_F(SafetensorsTest, RoundTrip) {
  const std::vector<SafetensorsWriteItem> items = {
      {"a.weight", "BF16", {3, 5}, Pattern(30, 1)},
      {"b.bias", "F32", {7}, Pattern(28, 2)},
      {"c.half", "F16", {2, 1, 2}, Pattern(8, 3)},
      {"ids", "I64", {3}, Pattern(24, 4)},
      {"empty", "F32", {0, 4}, {}},
      {"scalar", "U8", {}, Pattern(1, 5)},
  };
  const std::string path = Path("x.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, items, {{"format", "pt"}, {"note", "hello"}}).ok());

  // The header is padded with spaces so the data section starts 8-byte aligned.
  std::ifstream in(path, std::ios::binary);
  uint8_t len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  EXPECT_EQ(n % 8, 0u);

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->path(), path);
  EXPECT_EQ((*file)->metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"note", "hello"}}));
  ASSERT_EQ((*file)->tensors().size(), items.size());
  for (const SafetensorsWriteItem& item : items) {
    SCOPED_TRACE(item.name);
    const SafetensorsTensor& t = (*file)->tensors().at(item.name);
    EXPECT_EQ(t.name, item.name);
    EXPECT_EQ(t.dtype_name, item.dtype_name);
    EXPECT_EQ(t.shape, item.shape);
    ASSERT_EQ(t.nbytes, static_cast<int64_t>(item.bytes.size()));
    EXPECT_EQ(std::vector<uint8_t>(t.data, t.data + t.nbytes), item.bytes);
  }
  EXPECT_EQ((*file)->tensors().at("a.weight").dtype, DType::kBF16);
  EXPECT_EQ((*file)->tensors().at("b.bias").dtype, DType::kF32);
  EXPECT_EQ((*file)->tensors().at("c.half").dtype, DType::kF16);
  EXPECT_EQ((*file)->tensors().at("ids").dtype, std::nullopt);
}

TEST_F(SafetensorsTest, EmptyHeaderObjectIsAValidFile) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(WriteRaw("e.safetensors", "{}      ", 0));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->tensors().empty());
}

TEST_F(SafetensorsTest, UnknownDtypeIsExposedWithoutSizeCheck) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(
      WriteRaw("q.safetensors", R"({"q": {"dtype": "Q4_K", "shape": [64], "data_offsets": [0, 36]}})", 36));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().at("q").dtype, std::nullopt);
  EXPECT_EQ((*file)->tensors().at("q").nbytes, 36);
}

TEST_F(SafetensorsTest, MissingFile) {
  ExpectError(Path("nope.safetensors"), absl::StatusCode::kNotFound, {});
}

TEST_F(SafetensorsTest, EmptyFile) {
  ExpectError(WriteBytes("empty.safetensors", ""), absl::StatusCode::kDataLoss, {"too short"});
}

TEST_F(SafetensorsTest, FiveByteFile) {
  ExpectError(WriteBytes("five.safetensors", "abcde"), absl::StatusCode::kDataLoss, {"5 bytes", "too short"});
}

TEST_F(SafetensorsTest, HeaderLengthPastEnd) {
  const std::string path = WriteRaw("long.safetensors", "{}", 10, 1000);
  ExpectError(path, absl::StatusCode::kDataLoss,
              {"header length 1000 runs past the end of the file of size 20"});
}

TEST_F(SafetensorsTest, HeaderLengthAboveLimit) {
  // A sparse file: 8 + 101 MB of zeros; the length is rejected before the header is read.
  const std::string path = WriteRaw("huge.safetensors", "", 0, 101'000'000);
  std::filesystem::resize_file(path, 8 + 101'000'000);
  ExpectError(path, absl::StatusCode::kInvalidArgument, {"header length 101000000", "limit"});
}

TEST_F(SafetensorsTest, HeaderNotJson) {
  ExpectError(WriteRaw("nj.safetensors", "{not json", 0), absl::StatusCode::kInvalidArgument,
              {"not valid JSON"});
}

TEST_F(SafetensorsTest, HeaderNotAnObject) {
  ExpectError(WriteRaw("arr.safetensors", "[1, 2, 3]", 0), absl::StatusCode::kInvalidArgument,
              {"not a JSON object"});
}

TEST_F(SafetensorsTest, EntryNotAnObject) {
  ExpectError(WriteRaw("e.safetensors", R"({"w": [1, 2]})", 0), absl::StatusCode::kInvalidArgument,
              {"tensor 'w'", "not an object"});
}

TEST_F(SafetensorsTest, MissingDtype) {
  ExpectError(WriteRaw("d.safetensors", R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", 8),
              absl::StatusCode::kInvalidArgument, {"tensor 'w'", "dtype"});
}

TEST_F(SafetensorsTest, MissingDataOffsets) {
  ExpectError(WriteRaw("m.safetensors", R"({"w": {"dtype": "F32", "shape": [2]}})", 8),
              absl::StatusCode::kInvalidArgument, {"tensor 'w'", "data_offsets"});
}

TEST_F(SafetensorsTest, MalformedDataOffsets) {
  ExpectError(WriteRaw("m.safetensors", R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", 8),
              absl::StatusCode::kInvalidArgument, {"tensor 'w'", "data_offsets"});
  ExpectError(
      WriteRaw("n.safetensors", R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})", 8),
      absl::StatusCode::kInvalidArgument, {"tensor 'w'", "data_offsets"});
}

TEST_F(SafetensorsTest, OffsetsPastEnd) {
  ExpectError(
      WriteRaw("p.safetensors", R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 12),
      absl::StatusCode::kDataLoss, {"tensor 'w'", "past the end of the data section (12 bytes)"});
}

TEST_F(SafetensorsTest, EndBeforeBegin) {
  ExpectError(
      WriteRaw("r.safetensors", R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", 8),
      absl::StatusCode::kInvalidArgument, {"tensor 'w'", "[8, 4]"});
}

TEST_F(SafetensorsTest, SizeMismatchWithShape) {
  ExpectError(
      WriteRaw("s.safetensors", R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 16]}})", 16),
      absl::StatusCode::kInvalidArgument, {"tensor 'w'", "[2,3]", "BF16", "needs 12"});
}

TEST_F(SafetensorsTest, ShapeProductOverflow) {
  ExpectError(WriteRaw("o.safetensors",
                       R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296],
                                 "data_offsets": [0, 0]}})",
                       0),
              absl::StatusCode::kInvalidArgument, {"tensor 'w'", "overflow"});
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  ExpectError(WriteRaw("ov.safetensors",
                       R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                           "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                       12),
              absl::StatusCode::kInvalidArgument, {"'a'", "'b'", "overlap"});
}

TEST_F(SafetensorsTest, ContainedTensorOverlaps) {
  ExpectError(WriteRaw("nest.safetensors",
                       R"({"a": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
                           "b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]},
                           "c": {"dtype": "U8", "shape": [2], "data_offsets": [8, 10]}})",
                       16),
              absl::StatusCode::kInvalidArgument, {"'a'", "overlap"});
}

TEST_F(SafetensorsTest, NegativeShape) {
  ExpectError(
      WriteRaw("n.safetensors", R"({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 0]}})", 0),
      absl::StatusCode::kInvalidArgument, {"tensor 'w'", "shape [2,-1]"});
}

TEST_F(SafetensorsTest, BadMetadata) {
  ExpectError(WriteRaw("md.safetensors", R"({"__metadata__": {"format": 1}})", 0),
              absl::StatusCode::kInvalidArgument, {"__metadata__", "'format'"});
  ExpectError(WriteRaw("md2.safetensors", R"({"__metadata__": "pt"})", 0), absl::StatusCode::kInvalidArgument,
              {"__metadata__"});
}

TEST_F(SafetensorsTest, WriterRejectsWrongByteCount) {
  absl::Status s = WriteSafetensors(Path("w.safetensors"), {{"w", "F32", {2, 2}, Pattern(12, 0)}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("tensor 'w'"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("w.safetensors"));
}

TEST_F(SafetensorsTest, WriterReportsUnwritablePath) {
  absl::Status s = WriteSafetensors(Path("no/such/dir/w.safetensors"), {});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("no/such/dir/w.safetensors"));
}

}  // namespace
}  // namespace tandem
