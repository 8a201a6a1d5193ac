// The fuzzed entry points: what a peer or a user can hand tandem as bytes, each run on arbitrary
// input with the properties its contract promises checked (a broken property aborts, so both
// libFuzzer and the deterministic loop report it as a crash):
//   * FuzzWireFrame: every wire decoder (common/wire.h) on the bytes; a frame that decodes must
//     pass its validator and re-encode to exactly the same bytes (tried as given and with
//     body_bytes and the body crc made right, so that mutations reach the body checks);
//   * FuzzPromptsJsonl: the prompts-file parser and the id-list parser (cli/prompts.h); a file
//     that parses has at least one prompt, each with exactly one input;
//   * FuzzConfigYaml: the config loader (common/config.h) on a schema with every knob type, the
//     bytes as the YAML and their first line as a --set override; a config that loads dumps to
//     YAML that loads to the same values.
// Used by the libFuzzer targets (libfuzzer_*.cc, scripts/fuzz.sh) and by fuzz_loop_test (a fixed
// number of seeded mutations in ctest, with gcc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tandem::fuzz {

void FuzzWireFrame(const uint8_t* data, size_t size);
void FuzzPromptsJsonl(const uint8_t* data, size_t size);
void FuzzConfigYaml(const uint8_t* data, size_t size);

// Valid inputs of each entry (every wire format, prompt lines of every kind, configs of every
// knob type): the seeds the loop mutates and the committed corpus is made from.
std::vector<std::vector<uint8_t>> WireSeeds();
std::vector<std::string> PromptsSeeds();
std::vector<std::string> ConfigSeeds();

}  // namespace tandem::fuzz
