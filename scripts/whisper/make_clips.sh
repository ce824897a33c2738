#!/usr/bin/env bash
# Speech the Whisper tests and `scripts/bench audio` run on, made with
# espeak-ng (en-us, 150 words a minute) and sox from Debian, deterministic:
#   sN.wav      one sentence each of tests/fixtures/audio/sentences.txt, 16 kHz mono s16
#   long.wav    every sentence in turn, half a second apart (over 30 s: several windows)
#   s1.flac s1.mp3 s1.ogg   s1 in the other containers the daemon decodes
#   s1-44k-stereo.wav       s1 at 44.1 kHz, two channels (resampled by the daemon)
#   de1.wav     a German sentence (language detection and translation, multilingual models)
# Usage: make_clips.sh OUT_DIR
set -euo pipefail
out=$1
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
i=0
parts=()
while IFS= read -r line; do
  i=$((i + 1))
  espeak-ng -v en-us -s 150 -w "$out/raw$i.wav" "$line"
  sox "$out/raw$i.wav" -r 16000 -c 1 -b 16 "$out/s$i.wav"
  sox "$out/s$i.wav" "$out/pad$i.wav" pad 0 0.5
  parts+=("$out/pad$i.wav")
  rm "$out/raw$i.wav"
done < "$here/tests/fixtures/audio/sentences.txt"
sox "${parts[@]}" "$out/long.wav"
rm "${parts[@]}"
sox "$out/s1.wav" "$out/s1.flac"
sox "$out/s1.wav" -C 128 "$out/s1.mp3"
sox "$out/s1.wav" "$out/s1.ogg"
sox "$out/s1.wav" -r 44100 -c 2 "$out/s1-44k-stereo.wav"
espeak-ng -v de -s 150 -w "$out/raw-de.wav" "Guten Morgen. Das Wetter ist heute sonnig und warm, und wir gehen in den Park."
sox "$out/raw-de.wav" -r 16000 -c 1 -b 16 "$out/de1.wav"; rm "$out/raw-de.wav"
echo "==> clips in $out: $(soxi -D "$out/long.wav") s long"
