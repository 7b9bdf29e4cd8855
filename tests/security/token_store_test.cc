// TokenStore: the --token-file format and the constant-time comparison, without processes.
#include "tokens.h"

#include "gtest/gtest.h"

namespace hsbn::server {
namespace {

TEST(TokenStore, ParsesLinesCommentsAndTheWildcard) {
  auto t = TokenStore::Parse("# header\n\njob-a  tok-a # trailing comment\n\t*\ttok-star\r\n",
                             "test");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->size(), 2u);
  EXPECT_EQ(t->at("job-a"), "tok-a");
  EXPECT_EQ(t->at("*"), "tok-star");
}

TEST(TokenStore, MalformedLinesNameTheLineButNeverTheToken) {
  auto three = TokenStore::Parse("job-a tok-a\njob-b secret-b extra\n", "f");
  ASSERT_FALSE(three.ok());
  EXPECT_NE(three.status().message().find("f line 2"), std::string::npos);
  EXPECT_EQ(three.status().message().find("secret-b"), std::string::npos);
  auto dup = TokenStore::Parse("job-a one\njob-a two\n", "f");
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("second token line"), std::string::npos);
  auto lone = TokenStore::Parse("job-a\n", "f");
  EXPECT_FALSE(lone.ok());
}

TEST(TokenStore, SameTokenIsExactEquality) {
  EXPECT_TRUE(TokenStore::SameToken("abc123", "abc123"));
  EXPECT_FALSE(TokenStore::SameToken("abc123", "abc124"));
  EXPECT_FALSE(TokenStore::SameToken("abc123", "abc12"));
  EXPECT_FALSE(TokenStore::SameToken("abc123", "abc1234"));
  EXPECT_FALSE(TokenStore::SameToken("abc123", ""));
  EXPECT_FALSE(TokenStore::SameToken("", "x"));
  EXPECT_FALSE(TokenStore::SameToken(std::string("a\0b", 3), std::string("a\0c", 3)));
  EXPECT_TRUE(TokenStore::SameToken(std::string("a\0b", 3), std::string("a\0b", 3)));
}

}  // namespace
}  // namespace hsbn::server
