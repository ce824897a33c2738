"""The gateway's web page (GET /) in a real browser: Debian's chromium,
headless, driven by selenium through chromedriver, with a fake microphone
that plays an espeak-ng clip. Holding the mic button and releasing it puts
the transcript in the box; sending it streams an answer; an attached image
is answered with an encoder miss, and a second question about it is an
encoder hit. Screenshots go to OUT_DIR.
    web_page.py BASE_URL WAV IMAGE OUT_DIR TEXT_MODEL VISION_MODEL"""
import os
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

base, wav, image, out, text_model, vision_model = sys.argv[1:7]
os.makedirs(out, exist_ok=True)
opts = Options()
opts.binary_location = "/usr/bin/chromium"
for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,820",
          "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
          f"--use-file-for-fake-audio-capture={wav}"]:
    opts.add_argument(a)
opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
wait = WebDriverWait(driver, 300)


def shot(name):
    path = os.path.join(out, name)
    driver.save_screenshot(path)
    print(f"screenshot {path}")


def answers():
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def wait_answer(n):
    wait.until(lambda d: len(answers()) >= n and answers()[n - 1].get_attribute("data-done"))
    a = answers()[n - 1]
    assert a.get_attribute("data-done") == "1", a.text
    return a


try:
    driver.get(base + "/")
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    mic = driver.find_element(By.ID, "mic")
    assert mic.is_displayed(), "the mic shows when a speech model is installed"
    shot("1-empty.png")

    # Hold to talk: press, keep holding while the clip plays, release.
    ActionChains(driver).click_and_hold(mic).pause(6.5).release().perform()
    prompt = driver.find_element(By.ID, "prompt")
    wait.until(lambda d: prompt.get_attribute("value").strip())
    heard = prompt.get_attribute("value")
    assert "Stella" in heard or "store" in heard, heard
    print(f"transcribed into the box: {heard!r}")
    shot("2-transcribed.png")

    Select(driver.find_element(By.ID, "model")).select_by_value(text_model)
    driver.find_element(By.ID, "send").click()
    first = wait_answer(1)
    body = first.find_element(By.CSS_SELECTOR, ".body").text
    assert body.strip(), "a streamed answer"
    assert "prompt tokens" in first.find_element(By.CSS_SELECTOR, ".stats").text
    print(f"answer: {body[:80]!r}")
    shot("3-answered.png")

    # Greedy by default, as the CLI: the same question in a new
    # conversation gets the same answer (at the API's default of 1.0 it
    # would not), and the temperature control says 0.
    driver.get(base + "/")
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    assert driver.find_element(By.ID, "temperature").get_attribute("value") == "0"
    Select(driver.find_element(By.ID, "model")).select_by_value(text_model)
    prompt = driver.find_element(By.ID, "prompt")
    prompt.send_keys(heard)
    prompt.send_keys(Keys.ENTER)
    again = wait_answer(1).find_element(By.CSS_SELECTOR, ".body").text
    assert again == body, f"greedy answers differ: {body!r} then {again!r}"
    print("the same question again: the same answer (greedy by default)")

    # A new conversation with the vision model: the image, then a second question about it.
    driver.get(base + "/")
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    Select(driver.find_element(By.ID, "model")).select_by_value(vision_model)
    driver.find_element(By.ID, "file").send_keys(image)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#tray img"))
    prompt = driver.find_element(By.ID, "prompt")
    prompt.send_keys("What is in this image?")
    prompt.send_keys(Keys.ENTER)
    stats = wait_answer(1).find_element(By.CSS_SELECTOR, ".stats").text
    assert "encoded ×1" in stats, stats
    print(f"first question about the image: {stats}")
    prompt.send_keys("Describe it once more.")
    prompt.send_keys(Keys.ENTER)
    stats = wait_answer(2).find_element(By.CSS_SELECTOR, ".stats").text
    assert "encoder hit ×1" in stats, stats
    print(f"second question about the image: {stats}")
    shot("4-image.png")
    # The 409 of the hash-first image protocol is expected (the image was new).
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "(Conflict)" not in e["message"]]
    assert not errors, errors
finally:
    driver.quit()
print("OK")
